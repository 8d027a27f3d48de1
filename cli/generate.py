"""sparsekit generate: continue a prompt, or chat, with a dense, pruned or packed model."""
from __future__ import annotations

import sys
from typing import Optional

import typer

from sparsekit.cli.common import JSON_OPTION, Terminated, emit_json, err_console, handle_errors, long_lived

HELP = (
    "Generate text with a dense, pruned or packed model, streaming it to stdout (tokens/s go to stderr).\n\n"
    "MODEL is a pruned HF directory, a packed TCA-BME directory, a hub id, or the demo alias smollm2-135m. "
    "--temperature 0 (the default) decodes greedily (on CUDA through the runtime's static-cache, CUDA-graph "
    "decoder); above 0 it samples from the top-p nucleus. Packed models on a GPU run each sparse layer in its "
    "fastest form (--prefer speed) or keep the packed weights only (--prefer memory).\n\n"
    "--chat reads one message per line from stdin and keeps the conversation (the tokenizer's chat template "
    "when it has one); /reset forgets it, /exit or end of input quits. --json prints the text and timings as "
    "one JSON document and streams nothing.\n\n"
    "Example: sparsekit generate smollm2-135m --prompt 'The capital of France is' --max-new-tokens 32"
)



def register(app: typer.Typer) -> None:
    app.command("generate", help=HELP)(generate_cmd)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _stats(r: dict) -> str:
    """``64 tokens in 0.72 s (88 tokens/s); first token after 0.05 s; warm-up 0.4 s (graph capture); ...``:
    the rate counts generation only, never the one-off warm-up."""
    rate = f" ({r['tokens_per_s']:.1f} tokens/s)" if r["tokens_per_s"] else ""
    first = f"; first token after {r['first_token_s']:.2f} s" if r["first_token_s"] is not None else ""
    warm = f"; warm-up {r['warmup_s']:.1f} s (graph capture)" if r.get("warmup_s") else ""
    return (f"{r['new_tokens']} tokens in {r['seconds']:.2f} s{rate}{first}{warm} "
            f"(prompt {r['prompt_tokens']} tokens; {r['engine']} on {r['device']})")


def _timings(r: dict) -> dict:
    keys = ("text", "prompt_tokens", "new_tokens", "seconds", "tokens_per_s", "first_token_s", "warmup_s",
            "decode_tokens_per_s", "engine", "notes")
    return {k: r[k] for k in keys}


@handle_errors
def generate_cmd(
    model: str = typer.Argument("smollm2-135m", metavar="MODEL",
                                help="Pruned or packed directory, hub id, or the demo alias smollm2-135m."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Text to continue (with --chat: the first message)."),
    chat: bool = typer.Option(False, "--chat", help="Chat: one message per stdin line, history kept; /reset, /exit."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Most tokens to generate per reply."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy; above 0 samples (try 0.7)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Sample from the smallest set of tokens with this much probability, in (0, 1]."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (same seed, same text)."),
    device: str = typer.Option("auto", "--device", help="auto | cuda | cpu"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (float16 on CUDA, float32 on CPU) | float16 | bfloat16 | float32"),
    prefer: str = typer.Option("speed", "--prefer", help="Packed models on a GPU: speed (each sparse layer in its fastest "
                               "form, measured at load) | memory (packed weights only)."),
    json_out: bool = typer.Option(False, "--json", help="Print the text and timings as one JSON document (no streaming)."),
) -> None:
    with long_lived():  # the imports and the model live to the exit: no GC passes over them (~1.5 s)
        from sparsekit.errors import SparsekitError
        from sparsekit.runtime.generate import check_sampling, generate_text, settings_dict

        sampling = check_sampling(max_new_tokens, temperature, top_p, seed)
        if prompt is None and not chat:
            raise SparsekitError("nothing to generate from: pass --prompt TEXT, or --chat to read messages from stdin")
        if prompt is not None and not prompt.strip():
            raise SparsekitError("the prompt is empty: pass some text, e.g. --prompt 'The capital of France is'")
        # the model stack (transformers, the runtime, torch._dynamo: seconds) only once the arguments are good
        from sparsekit.runtime.dispatch import PREFER

        if prefer not in PREFER:
            raise SparsekitError(f"--prefer must be speed or memory, got {prefer!r}")
        from transformers.utils import logging as hf_logging

        from sparsekit.runtime.loader import load

        hf_logging.disable_progress_bar()  # no weight-loading bars around the text
        hf_logging.set_verbosity_error()   # nor generation-flag warnings
        lm, tokenizer = load(model, device, dtype, prefer=prefer)
    dev = next(lm.parameters()).device
    head = {"model": model, "device": str(dev), "dtype": str(next(lm.parameters()).dtype).removeprefix("torch."),
            "sampling": settings_dict(sampling)}
    try:
        if chat:
            _chat(lm, tokenizer, sampling, prompt, head, json_out)
            return
        r = generate_text(lm, tokenizer, prompt, sampling, on_text=None if json_out else _write)
    except KeyboardInterrupt as e:  # the text generated so far is out already
        _write("\n")
        term = isinstance(e, Terminated)
        err_console.print("[bold red]terminated[/] (SIGTERM)" if term else "[bold red]interrupted[/]")
        raise typer.Exit(143 if term else 130)
    if json_out:
        emit_json({**head, "prompt": prompt, **_timings(r)})
        return
    _write("\n")
    _notes(r)
    err_console.print(f"[dim]{_stats(r)}[/]", highlight=False, soft_wrap=True)


def _notes(r: dict) -> None:
    from rich.markup import escape

    for note in r.get("notes", ()):
        err_console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)


def _left_stripped(sink):
    """``sink``, with the whitespace before the first word of a reply dropped."""
    started = False

    def write(text: str) -> None:
        nonlocal started
        if not started:
            text = text.lstrip()
            started = bool(text)
        if text:
            sink(text)

    return write


def _chat(lm, tokenizer, sampling, first: Optional[str], head: dict, json_out: bool) -> None:
    from sparsekit.runtime.generate import Chat

    chat = Chat(lm, tokenizer, sampling)
    if not chat.templated:
        err_console.print(f"[yellow]note:[/] {chat.PLAIN_NOTE}", highlight=False, soft_wrap=True)
    interactive = sys.stdin.isatty() and not json_out
    turns = []

    def messages():
        if first is not None:
            yield first
        while True:
            if interactive:
                err_console.print("[bold]>[/] ", end="")
            line = sys.stdin.readline()
            if not line:
                return
            yield line.rstrip("\r\n")

    for message in messages():
        text = message.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            chat.reset()
            if not json_out:
                err_console.print("[dim]conversation cleared[/]")
            continue
        r = chat.send(text, on_text=None if json_out else _left_stripped(_write))
        turns.append({"user": text, **_timings(r)})
        if not json_out:
            _write("\n")
            _notes(r)
            err_console.print(f"[dim]{_stats(r)}[/]", highlight=False, soft_wrap=True)
    if json_out:
        emit_json({**head, "chat_template": chat.templated, "turns": turns})
