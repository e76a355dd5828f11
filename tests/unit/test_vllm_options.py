"""The vLLM connector's pure part: options and the parameters it exchanges (vLLM's KV tensors
and which blocks move: test_vllm_cache.py; the connector itself runs in tests/vllm_compat)."""

from __future__ import annotations

import dataclasses

import pytest

from kvbridge.config import ManagerConfig
from kvbridge.integrations.vllm_options import (
    CONNECTOR_DEFAULTS,
    MANAGER_OPTIONS,
    ConnectorOptions,
    OptionsError,
    StepTimes,
    check_vllm_version,
    cpu_list,
)
from kvbridge.integrations.vllm_requests import (
    BLOCK_SIZES_KEY,
    BLOCKS_KEY,
    BOOTSTRAP_KEY,
    ROOM_KEY,
    STAGES_KEY,
    VERSION_KEY,
    RemotePrefill,
    stage_room,
    tokens_to_load,
)
from kvbridge.integrations.vllm_stats import ConnectorCounters
from kvbridge.wire.native import VERSION


def test_options_come_from_extra_config_with_their_types_checked() -> None:
    options = ConnectorOptions.from_extra_config(
        {"engine": "mooncake", "peer_timeout_s": 2, "metrics_port": 0, "staging": False}
    )
    assert (
        options.manager.engine,
        options.manager.peer_timeout_s,
        options.manager.metrics_port,
    ) == ("mooncake", 2.0, 0)
    config = options.manager_config(run_bootstrap=True, bootstrap_url=None)
    assert (config.engine, config.peer_timeout_s, config.staging) == ("mooncake", 2.0, False)
    assert ConnectorOptions.from_extra_config(None) == ConnectorOptions()
    with pytest.raises(OptionsError, match=r"unknown option.*peer_timeout; kvbridge knows"):
        ConnectorOptions.from_extra_config({"peer_timeout": 2})
    with pytest.raises(OptionsError, match=r"peer_timeout_s: '2' is not a valid float"):
        ConnectorOptions.from_extra_config({"peer_timeout_s": "2"})
    with pytest.raises(OptionsError, match="staging: 1 is not a valid bool"):
        ConnectorOptions.from_extra_config({"staging": 1})
    with pytest.raises(OptionsError, match="'loopback' is not a transfer engine between"):
        ConnectorOptions.from_extra_config({"engine": "loopback"})
    coalesced = ConnectorOptions.from_extra_config({"write_path": "coalesced"})
    assert coalesced.manager.write_path == "coalesced"
    with pytest.raises(OptionsError, match="write_path 'coalesced' goes through the staging"):
        ConnectorOptions.from_extra_config({"write_path": "coalesced", "staging": False})
    cross_layer = ConnectorOptions.from_extra_config({"kv_cache_layout": "BLHNC"})
    assert (cross_layer.kv_cache_layout, ConnectorOptions().kv_cache_layout) == ("BLHNC", None)
    with pytest.raises(OptionsError, match="'LHBNC' is not a layout kvbridge moves; choose LBHNC"):
        ConnectorOptions.from_extra_config({"kv_cache_layout": "LHBNC"})


def test_only_the_supported_vllm_release_starts() -> None:
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.3+cpu")
    with pytest.raises(RuntimeError, match=r"follows vLLM 0\.32\.x; this is vLLM 0\.33\.0"):
        check_vllm_version("0.33.0")


def test_remote_prefill_travels_in_kv_transfer_params() -> None:
    remote = RemotePrefill(
        "http://127.0.0.1:8998", 2**62 + 5, 300, "engine-a", "req-1", ((0, 10), (0, 0)), (32, 32)
    )
    params = remote.to_params()
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", 8998)
    assert RemotePrefill.from_params(params) == remote
    assert RemotePrefill.from_params({"do_remote_prefill": True, "remote_block_ids": [1]}) is None
    assert RemotePrefill.from_params(None) is None
    assert RemotePrefill.from_params([BOOTSTRAP_KEY]) is None
    with pytest.raises(OptionsError, match=f"{ROOM_KEY}: '7' is not an integer"):
        RemotePrefill.from_params({**params, ROOM_KEY: "7"})
    with pytest.raises(OptionsError, match=f"{BOOTSTRAP_KEY}: 'tcp://x' is not an http URL"):
        RemotePrefill.from_params({**params, BOOTSTRAP_KEY: "tcp://x"})
    with pytest.raises(OptionsError, match=f"{BLOCKS_KEY}.*is not \\[first, count\\]"):
        RemotePrefill.from_params({**params, BLOCKS_KEY: [[0], [0, 0]]})
    with pytest.raises(OptionsError, match="one entry per KV cache group, got 2 and 1"):
        RemotePrefill.from_params({**params, BLOCK_SIZES_KEY: [32]})
    # A prefill instance of another release is refused, both versions named.
    assert params[VERSION_KEY] == VERSION
    with pytest.raises(OptionsError, match=r"speaks 'kvbridge/1\.5', this decode .*run one"):
        RemotePrefill.from_params({**params, VERSION_KEY: "kvbridge/1.5"})
    older = {key: value for key, value in params.items() if key != VERSION_KEY}
    with pytest.raises(OptionsError, match=f"names no version, this decode instance {VERSION}"):
        RemotePrefill.from_params(older)


def test_each_pipeline_stage_has_its_bootstrap_and_rooms() -> None:
    stages = ("http://10.0.0.1:9000", "http://10.0.0.1:9001")
    remote = RemotePrefill(stages[0], 41, 64, "e", "r", ((0, 2), (0, 1)), (32, 32), stages)
    params = remote.to_params()
    assert params[STAGES_KEY] == list(stages)
    assert RemotePrefill.from_params(params) == remote
    one = RemotePrefill.from_params({**params, STAGES_KEY: [stages[0]]})
    assert one is not None
    assert one.stages == stages[:1]
    with pytest.raises(OptionsError, match="does not begin with kvbridge_bootstrap_url"):
        RemotePrefill.from_params({**params, STAGES_KEY: list(reversed(stages))})
    with pytest.raises(OptionsError, match=rf"{STAGES_KEY}\[1\]: 'x' is not an http URL"):
        RemotePrefill.from_params({**params, STAGES_KEY: [stages[0], "x"]})
    # Distinct rooms per stage, stage 0's the group's own, never past 63 bits.
    rooms = {stage_room(room, stage) for room in (41, 2**63 - 1) for stage in range(4)}
    assert len(rooms) == 8
    assert stage_room(41, 0) == 41
    assert max(rooms) < 2**63


def test_decode_loads_only_what_its_prefix_cache_lacks() -> None:
    remote = RemotePrefill("http://h:1", 1, num_tokens=150, engine_id="", request_id="")
    assert tokens_to_load(remote, num_prompt_tokens=150, num_computed=0) == 150
    assert tokens_to_load(remote, num_prompt_tokens=150, num_computed=96) == 54
    assert tokens_to_load(remote, num_prompt_tokens=120, num_computed=0) == 120
    assert tokens_to_load(remote, num_prompt_tokens=150, num_computed=160) == 0


def test_counters_report_what_moved_since_the_last_report() -> None:
    earlier = ConnectorCounters(requests_loaded=2, pages_loaded=10)
    now = ConnectorCounters(requests_loaded=3, pages_loaded=14, loads_failed=1)
    assert now.since(earlier) == {"requests_loaded": 1, "pages_loaded": 4, "loads_failed": 1}
    assert now.since(now) == {}


def test_cpu_lists_read_as_linux_writes_them() -> None:
    assert cpu_list("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert cpu_list("1") == {1}


def test_step_times_average_compute_steps_and_bound_the_batch_window() -> None:
    times = StepTimes()
    assert times.batch_window(1.0, ended=1, in_flight=7) == 0.0  # nothing measured: no wait
    times.record(0.1)
    assert times.typical_s == pytest.approx(0.1)
    # The share of a step the loads still in flight are worth: most of it while most loads
    # are still coming, little once most are here, never a whole step.
    assert times.batch_window(1.0, ended=1, in_flight=7) == pytest.approx(0.0875)
    assert times.batch_window(1.0, ended=4, in_flight=4) == pytest.approx(0.05)
    assert times.batch_window(1.0, ended=7, in_flight=1) == pytest.approx(0.0125)
    assert times.batch_window(1.0, ended=1, in_flight=10**6) < times.typical_s
    assert times.batch_window(0.02, ended=1, in_flight=7) == pytest.approx(0.02)  # the cap
    assert times.batch_window(1.0, ended=8, in_flight=0) == 0.0  # nothing left to wait for
    # Ends at a known pace: the rest are due within a step, so the window covers them with a
    # gap to spare — here the last of 8 loads ending 12.5 ms apart (the share rule alone
    # would give it exactly one gap, and any jitter would start the others without it).
    assert times.batch_window(1.0, ended=7, in_flight=1, gap_s=0.0125) == pytest.approx(0.025)
    assert times.batch_window(1.0, ended=2, in_flight=6, gap_s=0.01) == pytest.approx(0.075)
    assert times.batch_window(1.0, ended=4, in_flight=4, gap_s=0.02) == pytest.approx(0.1)
    # Due later than a step: the share rule (the late ones would miss the next step anyway).
    assert times.batch_window(1.0, ended=2, in_flight=6, gap_s=0.03) == pytest.approx(0.075)
    assert times.batch_window(0.02, ended=7, in_flight=1, gap_s=0.0125) == pytest.approx(0.02)
    for _ in range(50):
        times.record(0.02)
    assert times.typical_s == pytest.approx(0.02, rel=1e-3)  # follows the recent steps
    assert times.batch_window(1.0, ended=4, in_flight=4) == pytest.approx(0.01, rel=1e-3)
    assert times.batch_window(0.0, ended=1, in_flight=7) == 0.0  # 0: each load reported at once


def test_the_connector_options_are_manager_config_fields_with_the_connector_defaults() -> None:
    manager_fields = {option.name for option in dataclasses.fields(ManagerConfig)}
    assert set(MANAGER_OPTIONS) <= manager_fields
    assert set(CONNECTOR_DEFAULTS) <= set(MANAGER_OPTIONS)
    config = ConnectorOptions().manager_config(run_bootstrap=False, bootstrap_url="http://h:1")
    assert (config.bootstrap_timeout_s, config.request_timeout_s, config.transfer_timeout_s) == (
        5.0,
        30.0,
        120.0,
    )
    assert config.bootstrap_url == "http://h:1"
    # What the connector does not set keeps the manager's own default.
    assert config.write_timeout_s == ManagerConfig().write_timeout_s
    options = ConnectorOptions.from_extra_config({"secret": "s3cret", "idle_batch_s": 0})
    assert (options.manager.secret, options.idle_batch_s) == (b"s3cret", 0.0)
    with pytest.raises(OptionsError, match="write_timeout_s"):  # not a connector option
        ConnectorOptions.from_extra_config({"write_timeout_s": 1})
