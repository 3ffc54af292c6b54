"""The job description: the graph of operators that the API builds and the
runtime runs (``graph.py``). Low in the layers so that the runtime, the
workers and Spark executors receive a plan without an ``Environment``."""
