"""``EngineArgs``: one definition behind the CLI flags, the worker argv, ``EngineConfig`` and ``LLM(...)``.
Fast: parses argv and builds configs; no model is loaded."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import engine.llm
from deploy import launcher
from deploy.cli import build_parser
from engine.args import EngineArgs
from engine.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
FIELDS = [f.name for f in dataclasses.fields(EngineArgs)]

# a value other than the default for every field (not all valid together: the argv side does not validate)
NON_DEFAULT: dict[str, Any] = {
    "model": "/models/llama",
    "tokenizer": "/models/llama-tokenizer",
    "dtype": "bfloat16",
    "max_model_len": 4096,
    "load_format": "dummy",
    "quantization": "awq",
    "seed": 7,
    "trust_remote_code": True,
    "skip_tokenizer_init": True,
    "block_size": 32,
    "gpu_memory_utilization": 0.55,
    "num_gpu_blocks_override": 123,
    "cpu_kv_cache_gib": 2.5,
    "enable_prefix_caching": False,
    "swap_space": 4.0,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 512,
    "scheduling_policy": "priority",
    "enable_chunked_prefill": False,
    "preemption_mode": "recompute",
    "tensor_parallel_size": 2,
    "distributed_executor_backend": "mp",
    "device": "cpu",
    "attention_backend": "torch",
    "enforce_eager": True,
    "async_scheduling": False,
}
# where each field lands in EngineConfig
CONFIG_PATH = {
    "model": "model.model",
    "dtype": "model.dtype",
    "max_model_len": "model.max_model_len",
    "load_format": "model.load_format",
    "quantization": "model.quantization",
    "tokenizer": "model.tokenizer",
    "seed": "model.seed",
    "trust_remote_code": "model.trust_remote_code",
    "skip_tokenizer_init": "model.skip_tokenizer_init",
    "block_size": "cache.block_size",
    "gpu_memory_utilization": "cache.gpu_memory_utilization",
    "num_gpu_blocks_override": "cache.num_gpu_blocks_override",
    "cpu_kv_cache_gib": "cache.cpu_kv_cache_gib",
    "enable_prefix_caching": "cache.enable_prefix_caching",
    "swap_space": "cache.swap_space_gib",
    "max_num_seqs": "scheduler.max_num_seqs",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "scheduling_policy": "scheduler.policy",
    "enable_chunked_prefill": "scheduler.enable_chunked_prefill",
    "preemption_mode": "scheduler.preemption_mode",
    "tensor_parallel_size": "parallel.tensor_parallel_size",
    "distributed_executor_backend": "parallel.distributed_executor_backend",
    "device": "device",
    "attention_backend": "attention_backend",
    "enforce_eager": "enforce_eager",
    "async_scheduling": "async_scheduling",
}


def _subparser(name: str) -> argparse.ArgumentParser:
    (sub,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def _lookup(config: EngineConfig, path: str) -> Any:
    value: Any = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def test_tables_cover_every_field() -> None:
    assert sorted(NON_DEFAULT) == sorted(FIELDS) == sorted(CONFIG_PATH)
    for name, value in NON_DEFAULT.items():
        default = next(f.default for f in dataclasses.fields(EngineArgs) if f.name == name)
        assert value != default, name


def test_defaults_are_the_configs() -> None:
    assert EngineArgs().create_engine_config() == EngineConfig()


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_every_field_is_a_flag(command: str) -> None:
    options = _options(_subparser(command))
    for name in FIELDS:
        assert "--" + name.replace("_", "-") in options, name
    assert "-tp" in options
    assert {"--no-enable-prefix-caching", "--no-enable-chunked-prefill"} <= options
    args = build_parser().parse_args([command])
    assert EngineArgs.from_cli_args(args) == EngineArgs()


def test_api_keeps_model_and_max_model_len_without_the_engine_group() -> None:
    options = _options(_subparser("api"))
    assert {"--model", "--max-model-len"} <= options
    assert "--max-num-seqs" not in options
    args = build_parser().parse_args(["api", "--model", "m", "--max-model-len", "99"])
    assert (args.model, args.max_model_len) == ("m", 99)


def test_every_field_has_help() -> None:
    for f in dataclasses.fields(EngineArgs):
        assert f.metadata.get("help"), f.name


@pytest.mark.parametrize("name", FIELDS)
def test_argv_round_trips_each_non_default(name: str) -> None:
    args = EngineArgs(**{name: NON_DEFAULT[name]})
    argv = args.to_argv()
    assert argv and argv[0] in ("--" + name.replace("_", "-"), "--no-" + name.replace("_", "-"))
    assert EngineArgs.from_cli_args(build_parser().parse_args(["worker", *argv])) == args
    standalone = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(standalone.parse_args(argv)) == args


def test_argv_round_trips_all_non_defaults_and_defaults() -> None:
    args = EngineArgs(**NON_DEFAULT)
    assert EngineArgs.from_cli_args(build_parser().parse_args(["worker", *args.to_argv()])) == args
    assert EngineArgs().to_argv() == []


def test_tp_alias_and_boolean_spellings() -> None:
    args = build_parser().parse_args(["serve", "-tp", "4", "--no-enable-prefix-caching", "--enforce-eager"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.tensor_parallel_size == 4
    assert not engine_args.enable_prefix_caching and engine_args.enforce_eager


def test_create_engine_config_values() -> None:
    values = NON_DEFAULT
    config = EngineArgs(**values).create_engine_config()
    for name, path in CONFIG_PATH.items():
        assert _lookup(config, path) == values[name], name


@pytest.mark.parametrize(
    "bad",
    [
        {"block_size": 3},
        {"swap_space": -1.0},
        {"preemption_mode": "swap"},  # with no swap space
        {"preemption_mode": "evict"},
        {"dtype": "int3"},
        {"scheduling_policy": "lifo"},
        {"device": "tpu"},
        {"attention_backend": "flash"},
        {"distributed_executor_backend": "uni", "tensor_parallel_size": 2},
        {"gpu_memory_utilization": 0.0},
    ],
)
def test_bad_values_raise_value_error(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        EngineArgs(**bad).create_engine_config()


def test_worker_argv_carries_the_engine_args() -> None:
    serve_argv = ["serve", "--model", "/m", "--served-model-name", "mine", "-tp", "2", "--max-num-seqs", "4"]
    serve_args = build_parser().parse_args([*serve_argv, "--no-enable-chunked-prefill", "--attention-backend", "torch"])
    argv = launcher._worker_argv(serve_args, "redis://127.0.0.1:1/0", 0)
    worker_args = build_parser().parse_args(argv[argv.index("worker") :])
    assert EngineArgs.from_cli_args(worker_args) == EngineArgs.from_cli_args(serve_args)
    assert EngineArgs.from_cli_args(worker_args).model == "/m"
    assert worker_args.served_model_name == "mine" and worker_args.redis_url == "redis://127.0.0.1:1/0"
    assert not worker_args.disable_log_stats
    quiet = launcher._worker_argv(build_parser().parse_args([*serve_argv, "--disable-log-stats"]), "redis://x", 0)
    assert build_parser().parse_args(quiet[quiet.index("worker") :]).disable_log_stats


class _NoEngine:
    def __init__(self, config: EngineConfig) -> None:
        raise AssertionError("the engine was built")


def test_llm_rejects_unknown_keywords_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.llm, "Engine", _NoEngine)
    with pytest.raises(TypeError, match="unknown_kw"):
        engine.llm.LLM("m", unknown_kw=1)
    with pytest.raises(ValueError, match="block_size"):
        engine.llm.LLM("m", block_size=3)


def test_llm_builds_the_engine_config_from_engine_args(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[EngineConfig] = []

    class _Recorder:  # LLM's finalizer needs a shutdown()
        def __init__(self, config: EngineConfig) -> None:
            seen.append(config)

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(engine.llm, "Engine", _Recorder)
    kwargs = {k: v for k, v in NON_DEFAULT.items() if k != "model"}
    engine.llm.LLM("/models/llama", **kwargs)
    config = EngineArgs(model="/models/llama", **kwargs).create_engine_config()
    assert not config.scheduler.offline  # a server's worker; LLM(...) marks its engine offline (vLLM's LLM_CLASS)
    assert seen == [dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, offline=True))]


def test_engine_args_and_the_cli_import_no_torch() -> None:
    code = "import sys, engine.args, deploy.cli, deploy.launcher; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_the_token_budget_defaults_to_vllms_server_value_for_the_device() -> None:
    """Unset, the budget is filled in where the engine starts: 2048 off large GPUs (vLLM's server default), and
    a configured value is kept as it is."""
    import torch

    from engine.model_runner import BATCHED_TOKENS, default_batched_tokens, with_batch_defaults

    unset = EngineArgs(device="cpu").create_engine_config()
    assert unset.scheduler.max_num_batched_tokens is None and EngineArgs().to_argv() == []
    with pytest.raises(RuntimeError, match="unset"):
        _ = unset.scheduler.token_budget
    assert default_batched_tokens(torch.device("cpu")) == BATCHED_TOKENS == 2048
    assert with_batch_defaults(unset).scheduler.token_budget == 2048
    given = EngineArgs(device="cpu", max_num_batched_tokens=640).create_engine_config()
    assert with_batch_defaults(given).scheduler.token_budget == 640


@pytest.mark.parametrize(
    ("gib", "name", "server", "offline"),
    [(141, "NVIDIA H200", 8192, 16384), (80, "NVIDIA H100 80GB HBM3", 8192, 16384), (80, "NVIDIA A100-SXM4-80GB", 2048,
     4096), (24, "NVIDIA L4", 2048, 4096), (192, "AMD Instinct MI300X", 8192, 16384)],
)  # fmt: skip
def test_the_token_budget_by_gpu_and_usage_is_vllms(gib: int, name: str, server: int, offline: int) -> None:
    """vLLM's ``get_batch_defaults`` on a GPU: 8192 for its server on >= 70 GiB but an A100, else 2048, and twice
    that for its offline ``LLM`` class, which ``engine.llm.LLM`` sets (``SchedulerConfig.offline``)."""
    from engine.model_runner import batch_default

    assert batch_default(gib << 30, name) == server
    assert batch_default(gib << 30, name, offline=True) == offline


@pytest.mark.parametrize(("num_tokens", "max_len"), [(8192, 256), (2048, 4096), (8192, 8192), (100, 7), (5, 512)])
def test_the_memory_profile_keeps_every_sequence_within_the_model_length(num_tokens: int, max_len: int) -> None:
    from engine.model_runner import profile_lens

    lens = profile_lens(num_tokens, max_len)
    assert sum(lens) == num_tokens and max(lens) <= min(512, max_len) and min(lens) >= 1
    assert max(lens) - min(lens) <= 1  # as even as it divides


def test_a_max_model_len_past_the_models_positions_is_refused() -> None:
    from types import SimpleNamespace

    from engine.model_runner import model_max_len

    hf = SimpleNamespace(max_position_embeddings=256)
    assert model_max_len(EngineArgs(max_model_len=256).create_engine_config(), hf) == 256
    assert model_max_len(EngineArgs().create_engine_config(), hf) == 256
    with pytest.raises(ValueError, match="longer than the model's 256 positions"):
        model_max_len(EngineArgs(max_model_len=257).create_engine_config(), hf)
