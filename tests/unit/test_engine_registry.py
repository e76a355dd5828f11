"""The engine registry: the one table of engines, their options and how they run."""

from __future__ import annotations

import pytest

from kvbridge.engines import (
    ENGINES,
    PROCESS_ENGINES,
    REGISTRY,
    EngineError,
    TransferEngine,
    create_engine,
    engine_spec,
    unavailable_reason,
)
from kvbridge.integrations.vllm_options import ConnectorOptions, OptionsError
from kvbridge_tools import bench


def test_every_entry_names_a_class_and_a_probe_that_exist() -> None:
    for spec in REGISTRY.values():
        assert issubclass(spec.engine_class(), TransferEngine)
        assert spec.engine_class().name == spec.name
    assert unavailable_reason("loopback") is None
    assert "unknown engine" in str(unavailable_reason("ucx"))
    assert tuple(REGISTRY) == ENGINES
    assert "loopback" in ENGINES
    assert "loopback" not in PROCESS_ENGINES


def test_what_users_choose_from_derives_from_the_registry() -> None:
    assert bench.ENGINES == PROCESS_ENGINES
    # The vLLM connector refuses the in-process engine by the registry's word.
    with pytest.raises(OptionsError, match="choose nixl or mooncake"):
        ConnectorOptions.from_extra_config({"engine": "loopback"})


def test_options_take_defaults_and_refuse_what_the_engine_does_not_have() -> None:
    mooncake = engine_spec("mooncake")
    defaults = {"protocol": "tcp", "device": "", "submit_threads": "0", "batch_blocks": "0"}
    assert mooncake.resolve(None) == defaults
    assert mooncake.resolve({"protocol": "rdma", "device": "mlx5_0"}) == {
        **defaults,
        "protocol": "rdma",
        "device": "mlx5_0",
    }
    with pytest.raises(
        EngineError,
        match=r"no option 'proto' \(its options: protocol, device, submit_threads, batch_blocks\)",
    ):
        mooncake.resolve({"proto": "rdma"})
    with pytest.raises(EngineError, match="protocol='udp': choose one of tcp, rdma"):
        mooncake.resolve({"protocol": "udp"})
    for bad in ("-1", "two", "٣", ""):
        with pytest.raises(EngineError, match=r"submit_threads=.*an integer of at least 0"):
            mooncake.resolve({"submit_threads": bad})
    with pytest.raises(EngineError, match=r"no option 'x' \(its options: none\)"):
        engine_spec("loopback").resolve({"x": "1"})
    with pytest.raises(EngineError, match="unknown engine; choose one of nixl, mooncake"):
        engine_spec("ucx")


def test_the_vllm_connector_passes_engine_options_through() -> None:
    options = ConnectorOptions.from_extra_config(
        {"engine": "mooncake", "engine_options": {"protocol": "rdma"}}
    )
    config = options.manager_config(run_bootstrap=False, bootstrap_url=None)
    assert (config.engine, dict(config.engine_options)) == ("mooncake", {"protocol": "rdma"})
    with pytest.raises(OptionsError, match=r"engine_options: mooncake: .*no option 'protocl'"):
        ConnectorOptions.from_extra_config(
            {"engine": "mooncake", "engine_options": {"protocl": "rdma"}}
        )
    with pytest.raises(OptionsError, match="is not an object of strings"):
        ConnectorOptions.from_extra_config({"engine_options": {"protocol": 1}})


def test_create_engine_opens_the_registered_class_with_its_options() -> None:
    engine = create_engine("loopback", "unit", options={})
    try:
        assert (engine.name, engine.transport) == ("loopback", "memcpy")
    finally:
        engine.close()
    with pytest.raises(EngineError, match="no option 'protocol'"):
        create_engine("loopback", "unit", options={"protocol": "tcp"})
