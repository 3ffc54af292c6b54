"""Aggregate functions (Flink's AggregateFunction): the interface, ``Count``
and ``Sum``."""
from __future__ import annotations

from typing import Callable

from pyflowbuf import errors
from pyflowbuf._validation import _callable


class AggregateFunction:
    """``create_accumulator()``, ``add(value, acc) -> acc``, ``get_result(acc)``,
    and ``merge(acc_a, acc_b) -> acc`` (needed by Session windows).

    Example::

        class Mean(fb.AggregateFunction):
            def create_accumulator(self):
                return (0, 0.0)                      # count, total
            def add(self, value, acc):
                return (acc[0] + 1, acc[1] + value["price"])
            def get_result(self, acc):
                return acc[1] / acc[0]
            def merge(self, a, b):
                return (a[0] + b[0], a[1] + b[1])

        mean_price = trades.key_by(lambda t: t["sym"]).window(fb.Tumbling(60)).aggregate(Mean())
    """

    def create_accumulator(self):
        """A new, empty accumulator for one window of one key.

        Example::

            def create_accumulator(self):
                return (0, 0.0)
        """
        raise NotImplementedError

    def add(self, value, accumulator):
        """Add record ``value`` to ``accumulator`` and return the accumulator (a
        new one, or the one given, changed).

        Example::

            def add(self, value, acc):
                return (acc[0] + 1, acc[1] + value["price"])
        """
        raise NotImplementedError

    def get_result(self, accumulator):
        """The window's result from its accumulator (by default the accumulator
        itself); it is what ``window_function`` receives, or the output record.

        Example::

            def get_result(self, acc):
                return acc[1] / acc[0]
        """
        return accumulator

    def merge(self, a, b):
        """The accumulator of two merged windows (Session windows merge). Without
        an override, ``aggregate`` on Session windows is refused with a
        ``ConfigurationError`` where it is declared.

        Example::

            def merge(self, a, b):
                return (a[0] + b[0], a[1] + b[1])
        """
        raise NotImplementedError(f"{type(self).__name__} has no merge(), which Session windows need")


class Count(AggregateFunction):
    """The number of records in the window.

    Example::

        counts = keyed.window(fb.Tumbling(60)).aggregate(fb.Count())
    """

    def create_accumulator(self):
        return 0

    def add(self, value, acc):
        return acc + 1

    def merge(self, a, b):
        return a + b


def _identity(x):
    return x


class Sum(AggregateFunction):
    """The sum of ``fn(record)`` over the window (of the records themselves
    without ``fn``: a stream of numbers).

    ``fn`` picks the number from a record. Without ``fn`` on a stream of a
    kind that holds no numbers (str, bytes, structs, Arrow) ``aggregate`` is
    refused with ``ConfigurationError``; a record that is no number fails
    the job with ``RecordTypeError``. A ``fn`` that is not callable is a
    ``TypeError``.

    Example::

        totals = orders_by_user.window(fb.Tumbling(3600)).aggregate(fb.Sum(lambda o: o["amount"]))
    """

    def __init__(self, fn: Callable = _identity):
        _callable(fn, "Sum")
        self.fn = fn

    def create_accumulator(self):
        return 0

    def add(self, value, acc):
        try:
            return acc + self.fn(value)
        except TypeError:
            if self.fn is not _identity:
                raise
            # the first such record, where a declaration could not know the
            # stream's kind (aggregate() refuses the kinds it does know)
            raise errors.RecordTypeError(
                f"Sum() adds up the records themselves, and this record is a {type(value).__name__} "
                f"({value!r:.80}): give Sum a function that picks the number, e.g. Sum(lambda r: r[1])"
            ) from None

    def merge(self, a, b):
        return a + b


# kinds whose records are never numbers: Sum() of the records cannot work
