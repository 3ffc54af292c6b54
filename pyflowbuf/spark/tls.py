"""Whether a job on a ``SparkCluster`` runs with TLS: Spark's own encryption
settings decide unless the cluster or the Environment says otherwise."""
from __future__ import annotations

import warnings

from pyflowbuf import errors
from pyflowbuf.net import tls as T

# any of these "true": Spark encrypts its traffic, so pyflowbuf's does too by default
SPARK_ENCRYPTION_KEYS = ("spark.network.crypto.enabled", "spark.ssl.enabled", "spark.ssl.rpc.enabled")


class UnencryptedExchangeWarning(UserWarning):
    """A job on an encrypting Spark cluster runs its exchange in the clear
    (``allow_unencrypted=True``)."""


def tls_setting(value):
    """``SparkCluster(tls=...)`` checked: True or a TLSConfig."""
    return T.resolve(value, "SparkCluster(tls=...)")


def spark_encrypts(conf) -> str | None:
    """The first of Spark's encryption settings that is on, or None."""
    for key in SPARK_ENCRYPTION_KEYS:
        if str(conf(key, "false")).strip().lower() == "true":
            return key
    return None


def choose_tls(cluster_tls, env_tls, allow_unencrypted: bool, conf):
    """The TLS setting of a job on Spark (True, a TLSConfig, or None: off).

    ``cluster_tls`` (SparkCluster(tls=)) wins, then ``env_tls``
    (Environment(tls=)); with neither, TLS is on when Spark encrypts. Spark
    encrypting and TLS off is refused unless ``allow_unencrypted`` (then a
    warning says so)."""
    key = spark_encrypts(conf)
    if allow_unencrypted and cluster_tls in (None, False) and env_tls in (None, False):
        if key is not None:
            warnings.warn(f"{key}=true: Spark encrypts its traffic, but allow_unencrypted=True runs pyflowbuf's "
                          "exchange, control channel and output relays in the clear (authenticated only); "
                          "drop allow_unencrypted to encrypt them with TLS", UnencryptedExchangeWarning,
                          stacklevel=4)
        return None
    if cluster_tls is False or (cluster_tls is None and env_tls is False):
        if key is not None:
            raise errors.ConfigurationError(
                f"{key}=true: Spark encrypts its traffic, but tls=False turns pyflowbuf's encryption off; "
                "drop tls=False (TLS is on by itself here), or pass SparkCluster(..., allow_unencrypted=True) "
                "if the records may cross the network in the clear")
        return None
    if cluster_tls is not None:
        return cluster_tls
    if env_tls not in (None, False):
        return T.resolve(env_tls)
    return True if key is not None else None
