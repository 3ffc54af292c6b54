"""Exceptions raised by pyflowbuf.

Every error also subclasses the builtin a caller would naturally catch
(``ValueError``, ``TimeoutError``, ``BufferError``...), so code that does not
know pyflowbuf still handles it sensibly. C error codes become these
exceptions in exactly one place: ``pyflowbuf._core.errors``.
"""


class FlowBufError(Exception):
    """Base class of every pyflowbuf error."""


class InsufficientBuffersError(FlowBufError, MemoryError):
    """The NetworkBufferPool cannot guarantee a pool's minimum number of segments."""


class BufferRequestTimeout(FlowBufError, TimeoutError):
    """A blocking buffer request did not get a segment within its timeout."""


class PoolDestroyedError(FlowBufError, RuntimeError):
    """The LocalBufferPool was destroyed."""


class BufferRecycledError(FlowBufError, BufferError):
    """A Buffer was used or released after it went back to its pool."""


class RecordTooLargeError(FlowBufError, ValueError):
    """A record exceeds the configured maximum record size."""


class CorruptRecordError(FlowBufError, ValueError):
    """Bytes in a buffer do not form a valid record stream."""


class RecordTypeError(FlowBufError, TypeError):
    """A record does not fit its stream's kind (an ``int64`` stream got a
    ``str``, a ``struct`` record holds a set...), or a function returned
    something that is not what its operator emits (a ``str`` where an iterable
    of records belongs)."""


class KeyTypeError(FlowBufError, TypeError):
    """A ``key_by`` key whose type has no hash that is the same in every
    process (its ``hash()`` is salted per process or based on identity)."""


class ChannelClosedError(FlowBufError, RuntimeError):
    """The channel or gate was closed or cancelled."""


class CancelledError(FlowBufError):
    """A blocking operation was cancelled (job failure or cancel())."""


class ProtocolError(FlowBufError, ConnectionError):
    """A peer sent bytes that break the network protocol."""


class JobFailedError(FlowBufError, RuntimeError):
    """A task of the job raised; ``__cause__`` holds the original exception."""


__all__ = [n for n in dir() if n.endswith("Error") or n in ("FlowBufError", "BufferRequestTimeout")]


# --- remote exchange (pyflowbuf.net) ---

class AuthenticationError(ProtocolError):
    """A peer failed the shared-secret (HMAC) challenge-response handshake."""


class ConnectionLostError(FlowBufError, ConnectionError):
    """The peer of a remote exchange closed the connection, died or stopped
    answering (socket timeout / keepalive) while channels were still open."""


class RemoteError(FlowBufError, RuntimeError):
    """The peer reported an error (an ErrorResponse); ``error_kind`` names it."""

    def __init__(self, message, error_kind="RemoteError"):
        super().__init__(message)
        self.error_kind = error_kind


class PartitionNotFoundError(RemoteError, LookupError):
    """The producer does not export the requested (partition, subpartition)
    within the partition request timeout."""


__all__ = [n for n in dir() if n.endswith("Error") or n in ("FlowBufError", "BufferRequestTimeout")]


# --- job API and lifecycle (pyflowbuf.api, pyflowbuf.runtime) ---

class ConfigurationError(FlowBufError, ValueError):
    """A setting, a stream declaration or an argument of the job API is
    invalid; the message names the parameter. Raised before anything starts."""


class OutputExistsError(ConfigurationError, FileExistsError):
    """A file sink's output directory already holds output this run did not
    ask to replace or extend (``mode="error"``, the default): pass
    ``mode="overwrite"`` or ``mode="append"``, or choose another path."""


class ExecutorEnvironmentError(ConfigurationError):
    """Spark's executors cannot run a ``SparkCluster`` job's tasks: their
    Python cannot import pyflowbuf (or a dependency of it), has another
    version of it, or cannot be started. The message names the executors'
    Python and the fix (``PYSPARK_PYTHON``, or shipping the package)."""


class NotEnoughSlotsError(ConfigurationError, TimeoutError):
    """A ``SparkCluster`` has fewer free task slots than workers (barrier
    tasks start all at once): the cluster is too small, or its executors did
    not register within ``start_timeout``. The message names the slots found
    and needed."""


class AlreadyExecutedError(FlowBufError, RuntimeError):
    """An Environment executes its graph once (as Flink's does): a second
    ``execute()``, ``execute_async()`` or ``execute_iter()`` needs a new
    Environment."""


class PortUnavailableError(FlowBufError, OSError):
    """A port a job was configured to listen on (``prometheus_port=``) cannot
    be bound; ``errno`` is the operating system's."""


class InvalidTimestampError(FlowBufError, ValueError):
    """A record's event timestamp is NaN (or NaT/null): it belongs to no
    window, so it is refused, naming the operator, rather than dropped."""


class FileFormatError(FlowBufError, ValueError):
    """A file a source reads is not what it should be: not Parquet, a schema
    that differs from the other files', a CSV row with the wrong number of
    columns or a value that does not convert to its column's type. The
    message names the file and where in it."""


class KafkaBrokerError(FlowBufError, RuntimeError):
    """The local Kafka broker (``pyflowbuf.connectors.kafka_broker``) could
    not be fetched or started: no jars, no Java, or it did not come up."""


class KafkaJarsError(FlowBufError, RuntimeError):
    """Spark's Kafka connector (``pyflowbuf.spark.kafka_jars``) is not in its
    cache, or Maven could not fetch it for the installed PySpark."""


class KafkaConnectionError(FlowBufError, ConnectionError):
    """No Kafka broker answered at ``bootstrap_servers`` within the stated
    timeout (``read_kafka``/``write_kafka``'s ``connect_timeout``)."""


class KafkaTopicError(FlowBufError, LookupError):
    """A topic that ``read_kafka`` reads (or ``write_kafka`` writes) does not
    exist, and waiting for it was not asked for."""


class KafkaDecodeError(FlowBufError, ValueError):
    """A Kafka record's value (or key) is not in the format ``read_kafka``
    was told; the message names topic, partition and offset."""


class KafkaSinkError(FlowBufError, RuntimeError):
    """``write_kafka`` could not deliver or commit: a record the broker
    refused, a transaction that failed, a producer fenced by a newer one, a
    step that did not end in time. Besides its message it carries what it
    knows (None where it does not apply): ``topic``, ``transactional_id``,
    ``step`` (``"commit_transaction"``...), ``checkpoint_id``,
    ``error_name`` (librdkafka's, e.g. ``"_FENCED"``), ``retriable`` and
    ``fatal`` (librdkafka's flags for that error). A client error it wraps
    is its ``__cause__``."""

    def __init__(self, message="", *, topic=None, transactional_id=None, step=None, checkpoint_id=None,
                 error_name=None, retriable=None, fatal=None):
        super().__init__(message)
        self.topic = topic
        self.transactional_id = transactional_id
        self.step = step
        self.checkpoint_id = checkpoint_id
        self.error_name = error_name
        self.retriable = retriable
        self.fatal = fatal


class KafkaFencedError(KafkaSinkError):
    """An exactly-once ``write_kafka`` producer was fenced: a newer producer
    initialized the same transactional id, which is what another job (or a
    second run of this one) writing with the same ``transactional_id_prefix``
    at the same time does."""


class UnitWarning(UserWarning):
    """A time value that only makes sense in another unit than the one it is
    read in: timestamps that look like milliseconds since 1970 where seconds
    are expected, ``checkpoint_interval=1000`` meant as milliseconds."""


class OperatorIdWarning(UserWarning):
    """A stateful operator of a checkpointed job has no ``uid()``: its state
    is stored under an id derived from its place in the graph, which a change
    of the job before it changes (its state would then be refused). The
    warning points at the line that declared the operator."""


class WorkerSideEffectWarning(UserWarning):
    """A ``sink(fn)`` ran in a forked worker process (``workers=``): what the
    function did to the caller's objects (appending to a list, counting)
    happened in the worker's copy of them, not in the caller."""


class SaltedHashError(ConfigurationError):
    """A key function calls ``hash()``, whose result for a str or bytes is
    salted per process (PYTHONHASHSEED), where a key must land in the same
    key group in another process or a later run: checkpoints on, or a
    SparkCluster. The message names the key function and the fix."""


class FreshStartWarning(UserWarning):
    """A job starts fresh (no ``restore_from``) in a checkpoint directory that
    holds checkpoints of an earlier run of the same job. A fresh start is what
    Flink does too, but a rerun that meant to resume would read its sources
    again from their start, and once it has completed its own checkpoints its
    retention removes the earlier run's: the message names the newest and the
    way to resume (``restore_from="latest"``)."""


class NonRestoredStateWarning(UserWarning):
    """A restore with ``allow_non_restored_state=True`` dropped the state of
    an operator the job no longer has; for a file sink also its pending
    commits (the message names the sink and its directory)."""


__all__ = [n for n in dir() if n.endswith(("Error", "Warning")) or n in ("FlowBufError", "BufferRequestTimeout")]


class TLSError(ProtocolError):
    """A TLS connection of the exchange, the control channel or an output
    relay failed: the handshake (not TLS, another CA, an expired certificate,
    one of another job or attempt, a wrong pinned fingerprint, a handshake
    that never finished) or a record after it (garbage, a renegotiation
    attempt). ``peer`` is the other end's address, ``reason`` why."""

    def __init__(self, peer, reason):
        super().__init__(f"TLS with {_peer_text(peer)} failed: {reason}")
        self.peer = peer
        self.reason = reason

    def __reduce__(self):
        return (type(self), (self.peer, self.reason))


class TLSUnavailableError(ConfigurationError):
    """TLS was asked for, but this Python has no ``ssl`` module (built
    without OpenSSL) or no ``cryptography`` package to make certificates."""


class CertificateValidityError(ConfigurationError):
    """A certificate given to ``tls=`` is expired or not valid yet (or no
    certificate of its CA is valid now), found at the job's start: every TLS
    handshake would refuse it. The message names the file and the date."""


class CertificateExpiryWarning(UserWarning):
    """A certificate given to ``tls=`` expires soon after the job's start:
    TLS handshakes after that date (a restart's, a savepoint command's) will
    be refused. The message names the file and the date."""


def _peer_text(peer):
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)
