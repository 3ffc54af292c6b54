"""Experiments that reproduce behaviour described in the reference material.

- :mod:`pyflowbuf.experiments.backpressure`: "How Apache Flink handles
  backpressure" - a producer and a consumer exchanging locally through two
  4 KiB buffers; slowing the consumer slows the producer to the same rate.
  Run ``python -m pyflowbuf.experiments.backpressure [--quick] [--out DIR]``.
- :mod:`pyflowbuf.experiments.throttle`: the sleep-based slow-downs they use.
"""
