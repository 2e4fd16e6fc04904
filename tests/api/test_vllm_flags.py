"""vLLM's ``serve`` flags on ``pagedserve``: parsed, carried to the API child and into the API's settings, or
refused by name before anything starts. No process is started here."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from api.settings import ApiSettings, load_chat_template
from deploy import launcher
from deploy.api_args import api_env, check_vllm_args, uvicorn_kwargs
from deploy.cli import build_parser, main

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


def _parse(*argv: str) -> argparse.Namespace:
    args = build_parser().parse_args(list(argv))
    check_vllm_args(args)
    return args


@pytest.mark.parametrize(
    "argv",
    [["serve", "/models/m"], ["serve", "/models/m", "--port", "9"], ["serve", "--port", "9", "/models/m"]],
)
def test_model_is_positional_as_in_vllm_serve(argv: list[str]) -> None:
    assert _parse(*argv).model == "/models/m"


def test_model_flag_still_works_and_agrees_with_the_positional() -> None:
    assert _parse("worker", "--model", "/m").model == "/m"
    assert _parse("api", "/m", "--model", "/m").model == "/m"
    with pytest.raises(ValueError, match="two models"):
        _parse("serve", "/a", "--model", "/b")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--trust-remote-code"], "--trust-remote-code is refused"),
        (["worker", "--kv-cache-dtype", "fp8"], "--kv-cache-dtype 'fp8' is not supported"),
        (["api", "--generation-config", "/no/such/folder"], "no generation_config.json in that folder"),
        (["api", "--chat-template", "/no/such/template.jinja"], "looks like a file path"),
        (["api", "--ssl-keyfile", "k.pem"], "both --ssl-keyfile and --ssl-certfile"),
    ],
)
def test_unimplemented_flags_are_refused_by_name_before_anything_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_accepted_vllm_values() -> None:
    args = _parse("serve", "--kv-cache-dtype", "auto", "--generation-config", "vllm", "--enable-chunked-prefill")
    assert args.enable_chunked_prefill and args.generation_config == "vllm"
    assert not _parse("serve", "--no-enable-chunked-prefill").enable_chunked_prefill
    assert _parse("api", "--tokenizer", "/t").tokenizer == "/t"


def test_tokenizer_reaches_the_api_child_and_the_workers() -> None:
    from deploy.launcher import _api_argv, _worker_argv
    from engine.args import EngineArgs

    args = _parse("serve", "/m", "--tokenizer", "/t")
    assert EngineArgs.from_cli_args(args).create_engine_config().model.tokenizer == "/t"
    for argv in (_api_argv(args, "redis://x"), _worker_argv(args, "redis://x", 0)):
        assert argv[argv.index("--tokenizer") + 1] == "/t"
    assert _parse("worker", "/m").tokenizer is None


@pytest.mark.parametrize(
    "raw", ['["https://a.example", "http://b.example:8080"]', "https://a.example,http://b.example:8080"]
)
def test_allowed_origins_json_as_vllm_or_comma_separated(raw: str) -> None:
    args = _parse("api", "--allowed-origins", raw)
    assert args.cors_origins == ("https://a.example", "http://b.example:8080")
    assert api_env(args)["PAGEDSERVE_CORS_ORIGINS"] == "https://a.example,http://b.example:8080"


def test_a_flag_given_wins_else_the_variable_else_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_MAX_QUEUE_DEPTH", "7")
    monkeypatch.setenv("PAGEDSERVE_RESPONSE_CACHE", "false")
    monkeypatch.setenv("PAGEDSERVE_REDIS_URL", "redis://elsewhere:6379/2")
    monkeypatch.setenv("PAGEDSERVE_RATE_LIMIT_RPS", "3")
    args = _parse("api", "--rate-limit-rps", "5", "--api-key", "k1", "--api-key", "k2")
    for name, value in api_env(args).items():  # what run_api does, before uvicorn's processes read them
        monkeypatch.setenv(name, value)
    settings = ApiSettings.from_env()
    assert settings.max_queue_depth == 7 and settings.response_cache is False  # the variables
    assert settings.redis_url == "redis://elsewhere:6379/2"
    assert settings.rate_limit_rps == 5.0 and settings.api_keys == ("k1", "k2")  # the flags
    assert settings.queue_deadline_s == ApiSettings().queue_deadline_s  # neither: the default
    assert "PAGEDSERVE_MAX_QUEUE_DEPTH" not in api_env(args)


def test_serve_hands_its_api_child_the_flags_given_and_nothing_else(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    serve_args = _parse(
        *["serve", "/m", "--served-model-name", "mine", "--max-model-len", "512", "--api-key", "k"],
        *["--allowed-origins", '["https://a.example"]', "--chat-template", str(template), "--disable-log-requests"],
        *["--no-response-cache", "--shared-response-cache", "--max-queue-depth", "3", "--uvicorn-log-level", "debug"],
        *["--root-path", "/llm", "--disable-uvicorn-access-log"],
    )
    argv = launcher._api_argv(serve_args, "redis://127.0.0.1:1/0")
    api_args = _parse(*argv[argv.index("api") :])
    assert api_env(api_args) == {**api_env(serve_args), "PAGEDSERVE_REDIS_URL": "redis://127.0.0.1:1/0"}
    assert uvicorn_kwargs(api_args) == uvicorn_kwargs(serve_args)
    assert "--rate-limit-rps" not in argv and "--queue-deadline-s" not in argv  # defaults stay the child's own
    env = api_env(api_args)
    assert env["PAGEDSERVE_LOG_REQUESTS"] == "False" and env["PAGEDSERVE_CHAT_TEMPLATE"] == str(template)
    assert env["PAGEDSERVE_MODEL"] == "/m" and env["PAGEDSERVE_MAX_MODEL_LEN"] == "512"


def test_uvicorn_keywords() -> None:
    args = _parse("api", "--log-level", "warning", "--root-path", "/llm", "--ssl-keyfile", "k", "--ssl-certfile", "c")
    kwargs = uvicorn_kwargs(args)
    assert kwargs["log_level"] == "warning" and kwargs["access_log"] is True  # --log-level when no uvicorn one
    assert (kwargs["root_path"], kwargs["ssl_keyfile"], kwargs["ssl_certfile"]) == ("/llm", "k", "c")
    args = _parse("api", "--uvicorn-log-level", "error", "--disable-uvicorn-access-log")
    assert uvicorn_kwargs(args)["log_level"] == "error" and uvicorn_kwargs(args)["access_log"] is False


def test_chat_template_from_a_file_or_inline(tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE  # not a file, but a template
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(os.fspath(tmp_path / "missing.jinja"))


def test_settings_take_auto_vllm_or_a_folder_as_generation_config(tmp_path: Path) -> None:
    assert ApiSettings().generation_config == "auto"  # vLLM's default
    assert ApiSettings(generation_config=str(tmp_path)).generation_config == str(tmp_path)
    with pytest.raises(ValueError, match="auto, vllm or a folder"):
        ApiSettings(generation_config="hf")


def test_serve_gives_both_tiers_the_model_of_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_MODEL", "/from/env")
    monkeypatch.setenv("PAGEDSERVE_MAX_MODEL_LEN", "256")
    args = _parse("serve")
    worker_argv = launcher._worker_argv(args, "redis://127.0.0.1:1/0", 0)
    assert worker_argv[worker_argv.index("--model") + 1] == "/from/env" and "256" in worker_argv
    assert _parse("serve", "/flag").model == "/flag"  # a flag given wins
