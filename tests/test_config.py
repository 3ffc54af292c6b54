"""The configuration objects behind Environment's keywords (pyflowbuf.config):
flat keywords and objects give the same Environment, a setting given both
ways is refused, each object checks itself, the old spelling of a setting
warns, and the runtime reads the objects' fields."""
from __future__ import annotations

import dataclasses
import os
import pickle
import re
import warnings

import pytest
from hypothesis import given, strategies as st

import pyflowbuf as fb
from pyflowbuf import config, errors
from pyflowbuf.checkpointing.coordinator import CheckpointSettings
from pyflowbuf.exchange.debloat import DebloatSettings

_CLASSES = {group: cls for group, (cls, _) in config.GROUPS.items()}

# valid values of each field, small enough to warn about no unit
_VALUES = {
    ("network", "segment_size"): st.sampled_from([256, 4096, 1 << 20]),
    ("network", "num_segments"): st.none() | st.integers(1, 4096),
    ("network", "buffer_timeout"): st.floats(0, 5),
    ("network", "output_buffers"): st.none() | st.integers(0, 8).flatmap(lambda lo: st.tuples(
        st.just(lo), st.integers(max(lo, 1), 20))),
    ("network", "max_record_size"): st.integers(1, (1 << 32) - 1),
    ("network", "credit_based"): st.booleans(),
    ("network", "bind_host"): st.sampled_from(["127.0.0.1", "localhost", "0.0.0.0"]),
    ("metrics", "interval"): st.floats(0.01, 100),
    ("metrics", "log"): st.none() | st.just("metrics.jsonl"),
    ("metrics", "prometheus_port"): st.none() | st.integers(0, 65535),
    ("metrics", "live_view"): st.booleans(),
    ("metrics", "ui_port"): st.none() | st.integers(0, 65535),
    ("metrics", "ui_host"): st.sampled_from(["127.0.0.1", "0.0.0.0", "::1", "localhost"]),
    ("checkpoint", "interval"): st.none() | st.floats(0.01, 100),
    ("checkpoint", "directory"): st.none() | st.sampled_from(["checkpoints", "memory://chk"]),
    ("checkpoint", "timeout"): st.floats(0.1, 1000),
    ("checkpoint", "retained"): st.integers(1, 10),
    ("checkpoint", "mode"): st.just("exactly_once"),
    ("checkpoint", "alignment"): st.just("unaligned"),
    ("checkpoint", "alignment_timeout"): st.none() | st.floats(0, 10),
    ("checkpoint", "incremental"): st.booleans(),
    ("restart", "attempts"): st.integers(0, 10),
    ("debloat", "enabled"): st.booleans(),
    ("debloat", "target"): st.floats(0.01, 10),
    ("debloat", "period"): st.floats(0.01, 10),
    ("debloat", "samples"): st.integers(1, 100),
    ("debloat", "threshold"): st.floats(0, 1),
    ("debloat", "min_buffer_size"): st.integers(1, 256),
}


def test_every_flat_keyword_has_a_field_and_a_test_strategy():
    for flat, (group, field) in config.FLAT.items():
        assert field in {f.name for f in dataclasses.fields(_CLASSES[group])}, flat
        assert (group, field) in _VALUES, flat
    fields = {(g, f.name) for g, cls in _CLASSES.items() for f in dataclasses.fields(cls)}
    assert fields == set(config.FLAT.values()), "a field without a flat keyword (or one too many)"


@st.composite
def settings(draw):
    """(flat keywords, the same settings as config objects)."""
    chosen = draw(st.sets(st.sampled_from(sorted(config.FLAT))))
    fields: dict = {}
    for flat in sorted(chosen):
        group, field = config.FLAT[flat]
        fields.setdefault(group, {})[field] = draw(_VALUES[group, field])
    ck = fields.get("checkpoint", {})
    if "alignment_timeout" in ck and ck["alignment_timeout"] is not None:
        ck["alignment"] = "unaligned"
    flat = {name: fields[g][f] for name, (g, f) in config.FLAT.items() if f in fields.get(g, {})}
    objects = {}
    for group, given_fields in fields.items():
        base = config.DEFAULTS[group]
        objects[group] = dataclasses.replace(base, **given_fields)
    return flat, objects


@given(settings())
def test_flat_keywords_and_config_objects_give_the_same_environment(pair):
    flat, objects = pair
    with warnings.catch_warnings():
        warnings.simplefilter("error")         # no unit warning, no deprecation for the current names
        # (but debloat settings without debloat=True say that debloating is off)
        warnings.filterwarnings("ignore", ".*tunes buffer debloating", UserWarning)
        a = fb.Environment(**flat)
        b = fb.Environment(**objects)
    assert a.configuration() == b.configuration()
    for name, value in flat.items():
        expected = tuple(value) if name == "output_buffers" and value is not None else value
        if name == "checkpoint_dir" and value is None and b.checkpoint_interval is not None:
            expected = "checkpoints/job"        # no directory given: the job's own, where it really is
        assert getattr(b, name) == expected, name
    # and back: configuration() builds an equal Environment
    assert fb.Environment(**a.configuration()).configuration() == a.configuration()


@given(settings(), st.data())
def test_a_setting_given_both_ways_is_refused_naming_it(pair, data):
    flat, _ = pair
    # (debloat= is the switch and the object's keyword both: one keyword cannot be given twice)
    name = data.draw(st.sampled_from(sorted(set(config.FLAT) - {"debloat"})))
    group, field = config.FLAT[name]
    value = getattr(config.DEFAULTS[group], field)        # even the default value counts as given
    obj = config.DEFAULTS[group] if group != "debloat" else fb.DebloatConfig()
    kw = {**{k: v for k, v in flat.items() if config.FLAT[k][0] != group}, group: obj, name: value}
    with pytest.raises(errors.ConfigurationError, match=rf"{name}=.*given twice"):
        fb.Environment(**kw)


def test_the_example_of_the_brief_and_the_docs():
    env = fb.Environment(checkpoint=fb.CheckpointConfig(interval=1.0, directory="chk"),
                         restart=fb.RestartConfig(attempts=2))
    assert (env.checkpoint_interval, env.checkpoint_dir, env.restart_attempts) == (1.0, "chk", 2)
    assert env.checkpoint_config == fb.CheckpointConfig(interval=1.0, directory="chk")
    with pytest.raises(errors.ConfigurationError, match=r"checkpoint_timeout= \(its timeout\).*given twice"):
        fb.Environment(checkpoint=fb.CheckpointConfig(interval=1.0), checkpoint_timeout=30)


def test_a_group_keyword_takes_its_own_class():
    with pytest.raises(errors.ConfigurationError, match="checkpoint= takes a pyflowbuf.CheckpointConfig"):
        fb.Environment(checkpoint=fb.NetworkConfig())
    with pytest.raises(errors.ConfigurationError, match="debloat= takes True, False or a pyflowbuf.DebloatConfig"):
        fb.Environment(debloat=1)
    with pytest.raises(errors.ConfigurationError, match="network= takes"):
        fb.Environment(network={"segment_size": 4096})
    env = fb.Environment()
    env.checkpoint_config = "every second"
    env.from_collection([1]).collect()
    with pytest.raises(errors.ConfigurationError, match="checkpoint_config must be a pyflowbuf.CheckpointConfig"):
        env.execute()


def test_objects_are_frozen_compare_by_value_and_pickle():
    c = fb.CheckpointConfig(interval=2.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.interval = 3.0
    assert c == fb.CheckpointConfig(interval=2.0) and hash(c) == hash(fb.CheckpointConfig(interval=2.0))
    assert c.replace(timeout=5.0) == fb.CheckpointConfig(interval=2.0, timeout=5.0) and c.timeout == 600.0
    for obj in (c, fb.NetworkConfig(output_buffers=[2, 4]), fb.DebloatConfig(), fb.MetricsConfig(),
                fb.RestartConfig(3), config.UNSET):
        assert pickle.loads(pickle.dumps(obj)) == obj
    assert pickle.loads(pickle.dumps(config.UNSET)) is config.UNSET
    assert fb.NetworkConfig(output_buffers=[2, 4]).output_buffers == (2, 4)
    assert fb.NetworkConfig(buffer_timeout=0).buffer_timeout == 0.0 and isinstance(
        fb.NetworkConfig(buffer_timeout=0).buffer_timeout, float)


@pytest.mark.parametrize("make, word", [
    (lambda: fb.CheckpointConfig(interval=0), "checkpoint_interval"),
    (lambda: fb.CheckpointConfig(interval=float("nan")), "checkpoint_interval"),
    (lambda: fb.CheckpointConfig(timeout=-1), "checkpoint_timeout"),
    (lambda: fb.CheckpointConfig(retained=0), "checkpoints_retained"),
    (lambda: fb.CheckpointConfig(mode="twice"), "checkpointing_mode"),
    (lambda: fb.CheckpointConfig(alignment="sideways"), "checkpoint_alignment"),
    (lambda: fb.CheckpointConfig(alignment_timeout=1.0), "alignment_timeout"),
    (lambda: fb.CheckpointConfig(alignment="unaligned", mode="at_least_once"), "exactly_once"),
    (lambda: fb.CheckpointConfig(directory=3), "checkpoint_dir"),
    (lambda: fb.RestartConfig(attempts=-1), "restart_attempts"),
    (lambda: fb.RestartConfig(attempts=True), "restart_attempts"),
    (lambda: fb.NetworkConfig(segment_size=1000), "segment_size"),
    (lambda: fb.NetworkConfig(num_segments=0), "num_segments"),
    (lambda: fb.NetworkConfig(buffer_timeout=-0.1), "buffer_timeout"),
    (lambda: fb.NetworkConfig(output_buffers=(3, 2)), "output_buffers"),
    (lambda: fb.NetworkConfig(output_buffers=4), "output_buffers"),
    (lambda: fb.NetworkConfig(max_record_size=1 << 32), "max_record_size"),
    (lambda: fb.NetworkConfig(bind_host=""), "bind_host"),
    (lambda: fb.DebloatConfig(enabled="yes"), "debloat"),
    (lambda: fb.DebloatConfig(target=0), "debloat_target"),
    (lambda: fb.DebloatConfig(samples=2.5), "debloat_samples"),
    (lambda: fb.DebloatConfig(threshold=1.5), "debloat_threshold"),
    (lambda: fb.DebloatConfig(min_buffer_size=0), "min_buffer_size"),
    (lambda: fb.MetricsConfig(interval=0), "metrics_interval"),
    (lambda: fb.MetricsConfig(prometheus_port=70000), "prometheus_port"),
    (lambda: fb.MetricsConfig(ui_port=-1), "ui_port"),
    (lambda: fb.MetricsConfig(ui_host=""), "ui_host"),
    (lambda: fb.MetricsConfig(log=5), "metrics_log"),
])
def test_each_object_checks_itself_naming_both_spellings(make, word):
    with pytest.raises(errors.ConfigurationError, match=word):
        make()


def test_settings_that_must_agree_across_objects():
    with pytest.raises(errors.ConfigurationError, match=r"min_buffer_size \(2048\) must be <= segment_size"):
        fb.Environment(network=fb.NetworkConfig(segment_size=1024), debloat=fb.DebloatConfig(min_buffer_size=2048))


def test_a_unit_warning_points_at_the_callers_line():
    with pytest.warns(errors.UnitWarning, match=r"checkpoint_interval \(CheckpointConfig.interval\)=5000") as rec:
        fb.CheckpointConfig(interval=5000)
    assert rec[0].filename == __file__
    with pytest.warns(errors.UnitWarning, match="buffer_timeout") as rec:
        fb.Environment(buffer_timeout=50)
    assert rec[0].filename == __file__


def test_debloat_takes_a_switch_or_an_object():
    assert not fb.Environment().debloat and fb.Environment().debloat_config == fb.DebloatConfig(enabled=False)
    assert fb.Environment(debloat=True).debloat_config == fb.DebloatConfig()
    assert fb.Environment(debloat=fb.DebloatConfig(target=0.5)).debloat_target == 0.5
    assert fb.Environment(debloat=True, debloat_target=0.5).debloat_config == fb.DebloatConfig(target=0.5)
    env = fb.Environment()
    env.debloat = fb.DebloatConfig(period=0.1)
    assert env.debloat is True and env.debloat_period == 0.1


def test_attributes_write_through_to_a_checked_copy():
    env = fb.Environment()
    before = env.checkpoint_config
    env.checkpoint_interval, env.checkpoint_dir = 0.5, "chk"
    assert env.checkpoint_config == fb.CheckpointConfig(interval=0.5, directory="chk")
    assert before == fb.CheckpointConfig()          # the old object did not change
    with pytest.raises(errors.ConfigurationError, match="segment_size"):
        env.segment_size = 1000
    assert env.segment_size == 32 * 1024


def test_checkpoint_mode_is_the_old_spelling_of_checkpoint_alignment():
    with pytest.warns(DeprecationWarning, match=r"checkpoint_mode=.*use checkpoint_alignment=") as rec:
        env = fb.Environment(checkpoint_interval=1.0, checkpoint_mode="unaligned")
    assert rec[0].filename == __file__
    assert env.checkpoint_config.alignment == "unaligned" and env.checkpoint_alignment == "unaligned"
    with pytest.warns(DeprecationWarning, match="Environment.checkpoint_mode is deprecated"):
        assert env.checkpoint_mode == "unaligned"
    with pytest.warns(DeprecationWarning):
        env.checkpoint_mode = "aligned"
    assert env.checkpoint_alignment == "aligned"
    with pytest.warns(DeprecationWarning), pytest.raises(errors.ConfigurationError, match="one setting"):
        fb.Environment(checkpoint_mode="unaligned", checkpoint_alignment="unaligned")
    with pytest.warns(DeprecationWarning), pytest.raises(errors.ConfigurationError, match="given twice"):
        fb.Environment(checkpoint=fb.CheckpointConfig(interval=1.0), checkpoint_mode="aligned")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fb.Environment(checkpoint_interval=1.0, checkpoint_alignment="unaligned", checkpointing_mode="exactly_once")


def test_the_runtime_takes_its_settings_from_the_objects():
    env = fb.Environment(max_parallelism=64, allow_pickle=True,
                         checkpoint=fb.CheckpointConfig(interval=0.5, directory="chk", alignment="unaligned",
                                                        alignment_timeout=0.2),
                         restart=fb.RestartConfig(3), network=fb.NetworkConfig(segment_size=4096),
                         debloat=fb.DebloatConfig(target=0.3, min_buffer_size=512))
    s = CheckpointSettings.from_env(env)
    assert (s.interval, s.directory, s.restart_attempts, s.alignment, s.alignment_timeout, s.max_parallelism,
            s.allow_pickle, s.switchable) == (0.5, "chk", 3, "unaligned", 0.2, 64, True, True)
    assert CheckpointSettings.from_env(fb.Environment()) is None
    d = DebloatSettings.from_env(env)
    assert (d.target, d.min_size, d.max_size) == (0.3, 512, 4096)


def test_the_runtime_reads_declared_fields_not_getattr_with_a_default():
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyflowbuf")
    pattern = re.compile(r"getattr\((?:self\.)?(?:job\.)?env\s*,\s*[\"'](\w+)")
    settings = {*config.FLAT, *config.DEPRECATED, *(attr for _, attr in config.GROUPS.values()),
                "parallelism", "max_parallelism", "chaining", "max_batch", "workers", "allow_pickle"}
    found = []
    for d in ("runtime", "spark"):
        for name in sorted(os.listdir(os.path.join(root, d))):
            if name.endswith(".py"):
                with open(os.path.join(root, d, name), encoding="utf-8") as f:
                    found += [f"{d}/{name}:{i}" for i, line in enumerate(f, 1)
                              if any(m in settings for m in pattern.findall(line))]
    assert not found, found


def test_a_job_runs_with_config_objects(tmp_path):
    env = fb.Environment(parallelism=2, network=fb.NetworkConfig(segment_size=4096, buffer_timeout=0.001),
                         checkpoint=fb.CheckpointConfig(interval=0.05, directory=str(tmp_path / "chk")),
                         metrics=fb.MetricsConfig(interval=0.05))
    out = env.from_sequence(0, 2000).map(lambda x: x * 2).collect()
    env.execute(timeout=60)
    assert sorted(out.result) == [2 * x for x in range(2000)]


def test_tuning_debloating_without_switching_it_on_warns():
    with pytest.warns(UserWarning, match="debloat=True"):
        env = fb.Environment(debloat_target=0.5)
    assert not env.debloat_config.enabled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fb.Environment(debloat=True, debloat_target=0.5).debloat_config.enabled
