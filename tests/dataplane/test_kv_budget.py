"""Sessions per shard from its KV budget (meshnode.dataplane.kv_budget) and the options that set them."""

from pathlib import Path

import pytest

from engines.tiny_model import TINY_N_LAYERS, ensure_tiny_model
from meshnode.app.cli import build_parser
from meshnode.app.session_options import max_sessions, parse_max_sessions, parse_size
from meshnode.commandline.config import ConfigError, parse_args_with_config
from meshnode.dataplane.kv_budget import (
    AUTO_BUDGET_CAP,
    AUTO_SESSIONS_CAP,
    LLAMA_MAX_SEQ,
    KvShapeError,
    default_budget,
    kv_bytes_per_token,
    mem_available_bytes,
    plan_sessions,
    session_kv_bytes,
    shard_session_plan,
    weight_bytes,
)

MIB = 2**20
# Gemma 3 270M's header: one KV head of 256 for K and for V, sliding-window layers among them.
GEMMA3 = {
    "general.architecture": "gemma3",
    "gemma3.embedding_length": 640,
    "gemma3.block_count": 18,
    "gemma3.attention.head_count": 4,
    "gemma3.attention.head_count_kv": 1,
    "gemma3.attention.key_length": 256,
    "gemma3.attention.value_length": 256,
    "gemma3.attention.sliding_window": 512,
}


def test_a_token_costs_its_kv_heads_times_k_and_v_in_f16_on_every_served_layer():
    # Sliding-window layers count in full: the engine runs llama.cpp with swa_full.
    assert kv_bytes_per_token(GEMMA3, range(18)) == 18 * 1 * (256 + 256) * 2
    assert kv_bytes_per_token(GEMMA3, range(9, 18)) == 9 * 512 * 2
    assert kv_bytes_per_token(GEMMA3, [0], bytes_per_element=1) == 512


def test_per_layer_head_counts_are_taken_for_the_cached_layers_only_and_a_copy_counts_again():
    metadata = {**GEMMA3, "gemma3.attention.head_count_kv": [0, 1, 2, 4]}
    assert kv_bytes_per_token(metadata, [2, 3, 3]) == (2 + 4 + 4) * 512 * 2
    with pytest.raises(KvShapeError):
        kv_bytes_per_token(metadata, range(2, 6))


def test_without_head_sizes_a_head_is_the_embedding_over_the_heads_and_every_head_has_kv():
    metadata = {
        "general.architecture": "llama",
        "llama.embedding_length": 64,
        "llama.attention.head_count": 8,
    }
    assert kv_bytes_per_token(metadata, range(2)) == 2 * 8 * (8 + 8) * 2
    with pytest.raises(KvShapeError):
        kv_bytes_per_token({"llama.embedding_length": 64}, [0])


def test_a_session_holds_its_context_rounded_up_to_whole_cells():
    assert session_kv_bytes(100, 4096) == 409_600
    assert session_kv_bytes(100, 1000) == 102_400


def test_the_budget_decides_between_one_and_the_cap():
    per = 72 * MIB
    assert plan_sessions(per, budget_bytes=11 * per - 1).sessions == 10
    fitting = plan_sessions(per, budget_bytes=10 * per)
    assert (fitting.sessions, fitting.reason) == (10, "budget")
    assert (plan_sessions(per, budget_bytes=per - 1).sessions, plan_sessions(per, budget_bytes=0).reason) == (
        1,
        "floor",
    )
    capped = plan_sessions(per, budget_bytes=1000 * per)
    assert (capped.sessions, capped.reason) == (AUTO_SESSIONS_CAP, "cap")
    assert "10 sessions of KV 72.0 MiB each in a budget of 720.0 MiB" in fitting.describe()


def test_an_explicit_count_wins_within_llama_cpps_limit_and_no_figure_falls_back():
    assert plan_sessions(MIB, chosen=100, budget_bytes=MIB).sessions == 100
    assert plan_sessions(MIB, chosen=1000).sessions == LLAMA_MAX_SEQ
    unknown = plan_sessions(MIB, fallback=4)
    assert (unknown.sessions, unknown.reason) == (4, "unknown")


def test_auto_budget_is_half_what_is_left_after_the_weights_capped():
    assert default_budget(1000 * MIB, 200 * MIB) == 400 * MIB
    assert default_budget(100 * MIB, 200 * MIB) == 0
    assert default_budget(64 * 2**30, 0) == AUTO_BUDGET_CAP
    assert default_budget(None, 0) is None


def test_mem_available_is_read_from_meminfo():
    text = "MemTotal:       32000000 kB\nMemFree:         1000 kB\nMemAvailable:   24197884 kB\n"
    assert mem_available_bytes(text) == 24197884 * 1024
    assert mem_available_bytes("MemTotal: 1 kB\n") is None


def test_a_shard_loads_its_blocks_and_every_tensor_outside_them():
    tensors = [("token_embd.weight", 100), ("blk.0.attn_q.weight", 10), ("blk.1.attn_q.weight", 20)]
    tensors += [("blk.10.ffn_up.weight", 40), ("output_norm.weight", 1)]
    assert weight_bytes(tensors, 1, 10) == 100 + 20 + 1
    assert weight_bytes(tensors, 0, 11) == 171


def test_a_real_models_shard_is_sized_from_its_header_and_the_machines_memory(tmp_path: Path):
    model = ensure_tiny_model()
    whole = shard_session_plan(model, None, 4096, budget_bytes=5 * 2**40)
    tail = shard_session_plan(model, (TINY_N_LAYERS // 2, TINY_N_LAYERS), 4096, budget_bytes=5 * 2**40)
    assert whole.per_session_bytes == 2 * tail.per_session_bytes > 0
    exact = shard_session_plan(model, None, 4096, budget_bytes=5 * whole.per_session_bytes)
    assert (exact.sessions, exact.reason) == (5, "budget")

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:       1 kB\n")
    assert shard_session_plan(model, None, 4096, meminfo=meminfo).reason == "floor"
    meminfo.write_text(f"MemAvailable: {64 * 2**20} kB\n")  # 64 GiB: the budget's cap holds
    capped = shard_session_plan(model, None, 4096, meminfo=meminfo)
    assert capped.budget_bytes == AUTO_BUDGET_CAP
    assert capped.sessions == min(AUTO_SESSIONS_CAP, AUTO_BUDGET_CAP // whole.per_session_bytes)


def test_the_options_parse_counts_sizes_and_auto():
    assert parse_max_sessions("auto") is None
    assert parse_max_sessions("12") == 12
    assert parse_size("AUTO") is None
    assert parse_size("2G") == 2 * 2**30
    assert parse_size("1.5GiB") == 3 * 2**29
    assert parse_size("512m") == 512 * MIB
    assert parse_size("4096") == 4096


@pytest.mark.parametrize(
    "argv", [["--max-sessions", "0"], ["--max-sessions", "257"], ["--kv-budget", "lots"]]
)
def test_bad_values_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args_with_config(build_parser(), ["start", *argv], {})


def test_the_options_come_from_the_environment_and_the_config_file(tmp_path: Path):
    config = tmp_path / "meshnode.toml"
    config.write_text('max-sessions = 6\nkv-budget = "512M"\n')
    from_file = parse_args_with_config(build_parser(), ["start", "--config", str(config)], {})
    assert (from_file.max_sessions, from_file.kv_budget) == (6, 512 * MIB)
    env = {"MESHNODE_MAX_SESSIONS": "auto", "MESHNODE_SERVE_KV_BUDGET": "1G", "MESHNODE_CONFIG": str(config)}
    from_env = parse_args_with_config(build_parser(), ["serve", "--model", "m.gguf"], env)
    assert (from_env.max_sessions, from_env.kv_budget) == (None, 2**30)
    defaults = parse_args_with_config(build_parser(), ["start"], {})
    assert (defaults.max_sessions, defaults.kv_budget) == (None, None)
    with pytest.raises(ConfigError):
        parse_args_with_config(build_parser(), ["start"], {"MESHNODE_MAX_SESSIONS": "many"})


def test_the_node_sizes_its_shard_with_the_options(tmp_path: Path):
    model = ensure_tiny_model()
    args = parse_args_with_config(build_parser(), ["start", "--max-sessions", "7"], {})
    assert max_sessions(args, model, None, 4096) == 7
    per = shard_session_plan(model, None, 4096, budget_bytes=1).per_session_bytes
    args = parse_args_with_config(build_parser(), ["start", "--kv-budget", str(3 * per)], {})
    assert max_sessions(args, model, (0, TINY_N_LAYERS), 4096) == 3
    # A file whose KV size cannot be read keeps the count from before auto; its load refuses it.
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf")
    assert max_sessions(parse_args_with_config(build_parser(), ["start"], {}), broken, None, 4096) == 4
