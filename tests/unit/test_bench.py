"""The benchmark matrix: which cells each preset has, and how cells are sized."""

from __future__ import annotations

from dataclasses import replace

from kvbridge_tools.bench import PRESETS, Cell, CellResult, cells, demo_config, markdown


def test_the_full_preset_is_the_whole_matrix() -> None:
    full = PRESETS["full"]
    found = cells(full, ("nixl", "mooncake"))
    assert len(found) == 2 * 3 * 4 * 3 * 3
    assert len(set(found)) == len(found)
    assert {c.model for c in found} == {"llama3-8b", "qwen2.5-7b", "deepseek-v3"}
    assert {(c.prefill_tp, c.decode_tp) for c in found} == {(1, 1), (2, 4), (4, 2)}
    assert {c.page_size for c in found} == {1, 16, 64}
    assert {c.tokens for c in found} == {128, 1024, 8192, 32768}


def test_the_quick_preset_sweeps_pages_and_tp_pairs_for_one_shape_and_length() -> None:
    quick = cells(PRESETS["quick"], ("nixl",))
    defaults = [c for c in quick if c.page_size == 16 and c.prefill_tp == c.decode_tp == 1]
    assert len(defaults) == 3 * 3  # every shape at every length
    swept = [c for c in quick if c not in defaults]
    assert {(c.model, c.tokens) for c in swept} == {("llama3-8b", 1024)}
    assert len(swept) == 3 * 3 - 1


def test_requests_scale_to_the_cell_bytes_and_the_memory_budget() -> None:
    quick = PRESETS["quick"]
    small = Cell("nixl", "llama3-8b", 128, 16, 1, 1)  # 16 MiB per request
    config = demo_config(small, quick, budget=64 << 30)
    assert not isinstance(config, str)
    assert config.requests == 16  # 256 MiB
    assert config.measure_raw
    tight = demo_config(small, quick, budget=128 << 20)  # two copies of 4 requests at most
    assert not isinstance(tight, str)
    assert tight.requests == 4
    large = Cell("nixl", "llama3-8b", 32768, 16, 1, 1)  # 4 GiB per request, two copies
    skipped = demo_config(large, replace(quick, tokens=(32768,)), budget=4 << 30)
    assert isinstance(skipped, str)
    assert "one request needs 8.0 GiB" in skipped


def test_a_replicated_latent_counts_once_per_rank() -> None:
    mla = Cell("nixl", "deepseek-v3", 1024, 16, 2, 4)  # 70 MiB per copy, six copies
    config = demo_config(mla, PRESETS["quick"], budget=64 << 30)
    assert not isinstance(config, str)
    assert demo_config(mla, PRESETS["quick"], budget=300 << 20) == (
        "one request needs 0.4 GiB, over this machine's budget of 0.3 GiB"
    )


def test_a_write_path_runs_every_cell_and_rows_written_before_it_read_back() -> None:
    direct = cells(PRESETS["quick"], ("nixl",), "direct")
    assert {c.write_path for c in direct} == {"direct"}
    assert direct[0].label.endswith("TP 1→1 direct")
    config = demo_config(direct[0], PRESETS["quick"], budget=1 << 40)
    assert not isinstance(config, str)
    assert config.transfer.write_path == "direct"
    # A row from before write paths: no chunks, no write_path in its cell.
    row = CellResult(cells(PRESETS["quick"], ("nixl",))[0], chunks={"ring (cost)": 2}).as_json()
    del row["chunks"], row["cell"]["write_path"]
    old = CellResult.from_json(row)
    assert (old.chunks, old.cell.write_path) == ({}, "auto")


def test_cross_layer_runs_the_cells_of_equal_tp_and_says_so() -> None:
    cross = cells(PRESETS["quick"], ("nixl",), cross_layer=True)
    everything = cells(PRESETS["quick"], ("nixl",))
    assert cross
    assert all(c.cross_layer and c.prefill_tp == c.decode_tp for c in cross)
    equal = [c for c in everything if c.prefill_tp == c.decode_tp]
    assert [replace(c, cross_layer=False) for c in cross] == equal
    assert cross[0].label.endswith("TP 1→1 cross-layer")
    config = demo_config(cross[0], PRESETS["quick"], budget=1 << 40)
    assert not isinstance(config, str)
    assert config.cross_layer
    row = CellResult(cross[0]).as_json()
    assert CellResult.from_json(row).cell == cross[0]
    del row["cell"]["cross_layer"]  # a row from before it
    assert not CellResult.from_json(row).cell.cross_layer
    assert "| nixl | llama3-8b (cross-layer) |" in markdown([CellResult(cross[0], requests=1)])
