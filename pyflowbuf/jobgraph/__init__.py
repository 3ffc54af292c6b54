"""The job description: the graph of operators that the API builds and the
runtime runs (``graph.py``), and the ``JobSpec`` that holds it with the
job's settings (``spec.py``). Low in the layers so that the runtime, the
workers and Spark executors receive a job without an ``Environment``."""
