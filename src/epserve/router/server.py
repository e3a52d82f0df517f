"""The router process: its options, the app they build, and serving it with uvicorn (``epserve
router``, or the process ``epserve serve`` starts, which also reads its supervisor's pipe: engine
instances that moved, and its end when the supervisor is gone). Nothing here imports torch."""

from __future__ import annotations

import logging
import os
import signal
import socket
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from epserve import env
from epserve.messages.sampling import MAX_LOGPROBS
from epserve.parallel.process import die_with_parent, name_process

logger = logging.getLogger(__name__)

BUILTIN_MODEL_NAME = "epserve-tiny"


@dataclass(frozen=True)
class RouterOptions:
    model: str | None  # checkpoint directory (tokenizer); None = the built-in tiny model
    engines: tuple[str, ...]
    prefill: tuple[str, ...] = ()  # disaggregation: prefill instances ...
    decode: tuple[str, ...] = ()  # ... and decode instances (instead of engines)
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "cache_aware"
    served_model_name: str | None = None
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    max_tree_tokens: int = 1 << 22
    refresh_interval_s: float = 1.0
    engine_wait_s: float = 20.0  # a request not yet started waits this long for a healthy instance
    log_level: str = "INFO"
    max_request_bytes: int = 4 << 20
    max_choices_per_request: int = 256
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    max_connections: int = 2048
    max_body_bytes: int | None = None  # request bodies held at once (None: 16 x max_request_bytes) ...
    max_client_body_bytes: int | None = None  # ... by one client (None: 8 x max_request_bytes)
    engine_token: str | None = field(default=None, repr=False)  # the engines' mutual TLS key (None: plaintext)
    api_key: str | None = field(default=None, repr=False)  # clients' Bearer key (None: open); never the engine token
    chat_template: str | None = field(default=None, repr=False)  # template text replacing the checkpoint's
    generation_config: str = "auto"  # sampling defaults: auto (the checkpoint's), vllm (none) or a directory
    reasoning_parser: str | None = None  # chat: the model's reasoning as reasoning_content (deepseek_r1)
    tool_call_parser: str | None = None  # chat: the checkpoint's tool-call format (deepseek_v3, deepseek_v31)
    enable_auto_tool_choice: bool = False  # tool_choice auto: the model decides whether to call
    response_role: str = "assistant"  # vLLM's --response-role: the chat response's role
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs' tokens as token_id:<id> unless a request says
    max_logprobs: int = MAX_LOGPROBS  # vLLM's: a request asking for more logprobs is refused (at most this)

    def __post_init__(self) -> None:
        _ = self.limits, self.output  # ValueError for bad limits or output flags, as soon as the options are made
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (deepseek_v3 or deepseek_v31)")
        if self.chat_template is not None:
            from epserve.chat_template import compile_chat_template

            compile_chat_template(self.chat_template)  # ValueError naming the syntax error

    @property
    def model_name(self) -> str:
        return self.served_model_name or (self.model if self.model is not None else BUILTIN_MODEL_NAME)

    @property
    def output(self):
        """vLLM's output flags (an ``OutputOptions``); ValueError for bad values."""
        from epserve.router.output_options import OutputOptions

        return OutputOptions(self.response_role, self.return_tokens_as_token_ids, self.max_logprobs)

    @property
    def limits(self):
        """The HTTP limits (an ``HTTPLimits``); ValueError for bad values."""
        from epserve.router.http_limits import HTTPLimits

        return HTTPLimits(
            max_request_bytes=self.max_request_bytes, max_choices_per_request=self.max_choices_per_request,
            header_timeout_s=self.header_timeout_s, body_timeout_s=self.body_timeout_s,
            keep_alive_timeout_s=self.keep_alive_timeout_s, max_connections=self.max_connections,
            max_body_bytes=self.max_body_bytes, max_client_body_bytes=self.max_client_body_bytes,
        )


def router_parts(options: RouterOptions):
    """The policy, the tokenizer (None if the model directory has none) and the sampling defaults of
    ``--generation-config``; ValueError for bad options."""
    from epserve.router.generation_defaults import GenerationDefaults
    from epserve.router.policy import make_policy
    from epserve.tokenizer import load_tokenizer

    policy = make_policy(
        options.policy, cache_threshold=options.cache_threshold, balance_abs_threshold=options.balance_abs_threshold,
        balance_rel_threshold=options.balance_rel_threshold, max_tree_tokens=options.max_tree_tokens,
    )
    if options.model is None:
        path = env.builtin_model_dir()
        if not (path / "config.json").is_file():  # written by the engine side first, unless run alone
            from epserve.presets import default_model_path

            path = default_model_path()
    else:
        path = Path(options.model)
        if not path.is_dir():
            raise ValueError(f"model directory {options.model} does not exist (the router reads its tokenizer)")
    tokenizer = load_tokenizer(path, options.chat_template, auto_tool_choice=options.enable_auto_tool_choice)
    if tokenizer is None and options.chat_template is not None:
        raise ValueError(f"--chat-template needs a tokenizer; the model directory {path} has no tokenizer.json")
    return policy, tokenizer, GenerationDefaults.resolve(options.generation_config, path)


def build_router(options: RouterOptions, api_key: str | None = None):
    """The router's ASGI server object (an OpenAIServer); ValueError for bad options. ``api_key``: the
    clients' key (default: ``options.api_key``); the engines are called with ``options.engine_token``
    alone, never with the API key (an HTTP client must not be able to pose as a router)."""
    from epserve.router.app import OpenAIServer
    from epserve.router.instances import Router

    api_key = api_key or options.api_key
    policy, tokenizer, defaults = router_parts(options)
    defaults.log()
    router = Router(options.engines, policy, options.refresh_interval_s, token=options.engine_token,
                    engine_wait_s=options.engine_wait_s, prefill=options.prefill, decode=options.decode)
    return OpenAIServer(router, tokenizer, options.model_name, api_key, options.limits, defaults,
                        options.reasoning_parser, (options.tool_call_parser, options.enable_auto_tool_choice),
                        options.output)


def check_port_free(host: str, port: int) -> None:
    """ValueError naming the address when the HTTP port cannot be bound (before anything starts)."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {os.strerror(e.errno) if e.errno else e}") from None


def run_router(options: RouterOptions, api_key: str | None = None, control: Connection | None = None) -> None:
    """Serve the OpenAI API until SIGINT/SIGTERM (uvicorn finishes open responses first). ``api_key``:
    the clients' key (default: ``options.api_key``). ``control``: the pipe from ``epserve serve``'s
    supervisor (engine instances that moved); when it ends the supervisor is gone, and so is this
    process, at once."""
    import uvicorn

    check_port_free(options.host, options.port)
    server = build_router(options, api_key)
    if control is not None:
        server.router.follow(control, _supervisor_gone)
    over = (f"engines {', '.join(options.engines)}" if options.engines else
            f"prefill instances {', '.join(options.prefill)} and decode instances {', '.join(options.decode)}")
    logger.info("router on http://%s:%d/v1 (model %r, policy %s) over %s", options.host, options.port,
                options.model_name, options.policy, over)
    from epserve.router.body_budget import map_large_buffers
    from epserve.router.http_connections import http_protocol

    map_large_buffers()  # (request bodies' memory goes back to the system when they are freed)
    limits = server.limits
    _raise_open_files_limit(2 * limits.max_connections + 256)  # open and refused connections, engines, files
    config = uvicorn.Config(server.app, host=options.host, port=options.port, log_level=options.log_level.lower(),
                            access_log=False, timeout_graceful_shutdown=60, log_config=None,  # our log format
                            http=http_protocol(limits, server.gate), ws="none", server_header=False,
                            timeout_keep_alive=limits.keep_alive_timeout_s)  # type: ignore[arg-type]
    # uvicorn stops gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler it found;
    # make that handler a no-op so a clean stop exits with code 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    uvicorn.Server(config).run()


def _raise_open_files_limit(wanted: int) -> None:
    """Raise this process's soft limit on open files towards ``wanted`` (up to the hard limit); warn
    when it stays below."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if soft < wanted:
            logger.warning("the open-file limit (%d) is below the %d that --max-connections may need; "
                           "lower --max-connections or raise the limit (ulimit -n)", soft, wanted)


def _supervisor_gone() -> None:
    logger.error("the supervisor (epserve serve) is gone; exiting")
    os._exit(1)


def router_main(options: RouterOptions, log_level: str, control: Connection | None = None) -> None:
    """Entry of the router process that ``epserve serve`` starts (the API key comes with ``options``,
    not in its environment); ``control``: the supervisor's pipe (see :func:`run_router`)."""
    die_with_parent()
    name_process("epserve-router")
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s router %(name)s: %(message)s")
    run_router(options, options.api_key, control)
