"""Whether a job on a SparkCluster runs with TLS (pyflowbuf.spark.tls):
Spark's encryption settings turn it on, tls= forces it on or off,
allow_unencrypted opts out with a warning. No Spark needed."""
import warnings

import pytest

from pyflowbuf import errors
from pyflowbuf.net import TLSConfig
from pyflowbuf.spark.tls import UnencryptedExchangeWarning, choose_tls


def conf_of(**on):
    keys = {k.replace("_", "."): v for k, v in on.items()}
    return lambda key, default=None: keys.get(key, default)


ENCRYPTING = [conf_of(spark_network_crypto_enabled="true"), conf_of(spark_ssl_enabled="TRUE"),
              conf_of(spark_ssl_rpc_enabled="true")]
PLAIN = conf_of()
MINE = TLSConfig(b"-----BEGIN CERTIFICATE-----", b"-----BEGIN PRIVATE KEY-----", b"-----BEGIN CERTIFICATE-----")


@pytest.mark.parametrize("conf", ENCRYPTING)
def test_spark_encryption_turns_tls_on(conf):
    assert choose_tls(None, None, False, conf) is True
    assert choose_tls(None, MINE, False, conf) is MINE          # Environment(tls=) says how
    assert choose_tls(MINE, None, False, conf) is MINE


def test_off_by_default_without_spark_encryption_and_forced_on():
    assert choose_tls(None, None, False, PLAIN) is None
    assert choose_tls(True, None, False, PLAIN) is True
    assert choose_tls(None, True, False, PLAIN) is True
    assert choose_tls(False, True, False, PLAIN) is None        # the cluster's setting wins


@pytest.mark.parametrize("conf", ENCRYPTING)
def test_turning_it_off_on_an_encrypting_cluster_is_refused(conf):
    with pytest.raises(errors.ConfigurationError, match="tls=False.*allow_unencrypted=True"):
        choose_tls(False, None, False, conf)
    with pytest.raises(errors.ConfigurationError, match="tls=False"):
        choose_tls(None, False, False, conf)


@pytest.mark.parametrize("conf", ENCRYPTING)
def test_allow_unencrypted_opts_out_with_a_warning(conf):
    with pytest.warns(UnencryptedExchangeWarning, match="in the clear"):
        assert choose_tls(None, None, True, conf) is None
    with pytest.warns(UnencryptedExchangeWarning):
        assert choose_tls(False, None, True, conf) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_tls(True, None, True, conf) is True       # asked for TLS: no opting out
        assert choose_tls(None, None, True, PLAIN) is None      # nothing to opt out of


def test_a_wrong_setting_is_refused():
    with pytest.raises(errors.ConfigurationError, match="SparkCluster\\(tls"):
        from pyflowbuf.spark.tls import tls_setting
        tls_setting("yes")
