"""Text generation from a loaded model (``runtime.loader.load``): one prompt, or a chat with history.

``generate_text`` continues one prompt and returns the text with its timings; ``on_text`` receives
the text token by token as it is produced (``TokenStreamer``), and on an interrupt (Ctrl-C, SIGTERM)
everything generated so far before the exception goes on. ``max_new_tokens`` is capped so that
prompt and reply fit the model's context (a ``SparsekitWarning`` says so). Two engines:

* ``"hf"``: transformers' ``model.generate`` (greedy, or sampling with temperature and top-p), with
  everything the model's generation config asks for; works everywhere.
* ``"static"``: the runtime's ``GreedyDecoder`` (static KV cache, the decode step replayed as one
  CUDA graph on a GPU): greedy only, stops at EOS like ``generate`` does. ``"auto"`` picks it for
  greedy decoding on CUDA when the generation config changes no logits (no repetition penalty,
  forced or suppressed tokens, ...), else ``"hf"``. Both give the same tokens (tests check it on
  the CPU, where the static engine runs the same step eagerly).

``Chat`` keeps the conversation and renders it with the tokenizer's chat template when it has one,
else as plain ``User:``/``Assistant:`` lines (the reply then stops at the next ``User:``).
"""
from __future__ import annotations

import math
import time
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch
from torch import nn

from sparsekit.errors import SparsekitError, SparsekitWarning, strict_mode

ENGINES = ("auto", "hf", "static")
# generation-config fields that change greedy logits: the static engine does not apply them
_LOGIT_FIELDS = ("repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "bad_words_ids",
                 "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
                 "sequence_bias", "min_length", "min_new_tokens", "exponential_decay_length_penalty")
_NEUTRAL = (None, 0, 1, 1.0, [], {})


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens: ``temperature`` 0 is greedy; else sampling from the top-p nucleus."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_sampling(max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                   seed: int | None = None) -> Sampling:
    """Validated :class:`Sampling` (one-line ``SparsekitError`` on a bad value)."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise SparsekitError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if not math.isfinite(temperature) or temperature < 0:
        raise SparsekitError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise SparsekitError(f"--top-p must be in (0, 1], got {top_p}")
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise SparsekitError(f"--seed {seed} is out of range: use a 64-bit integer, e.g. 0")
    return Sampling(max_new_tokens, float(temperature), float(top_p), seed)


def model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def eos_ids(model: nn.Module, tokenizer) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return set() if eos is None else {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def pick_engine(model: nn.Module, sampling: Sampling, engine: str = "auto") -> str:
    if engine not in ENGINES:
        raise SparsekitError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "static" and not sampling.greedy:
        raise SparsekitError("the static engine decodes greedily: use temperature 0 or the hf engine")
    if engine != "auto":
        return engine
    cfg = getattr(model, "generation_config", None)
    plain = cfg is None or all(getattr(cfg, f, None) in _NEUTRAL for f in _LOGIT_FIELDS)
    return "static" if sampling.greedy and plain and model_device(model).type == "cuda" else "hf"


class StopFilter:
    """Passes text on, holding back what could be the start of ``stop``; after ``stop``, nothing."""

    def __init__(self, sink: Callable[[str], None] | None, stop: str | None):
        self.sink, self.stop, self.pending, self.stopped = sink, stop, "", False

    def __call__(self, text: str) -> None:
        if self.stopped or not text:
            return
        if not self.stop:
            return self._emit(text)
        self.pending += text
        cut = self.pending.find(self.stop)
        if cut >= 0:
            self._emit(self.pending[:cut])
            self.pending, self.stopped = "", True
            return
        keep = next((n for n in range(min(len(self.stop) - 1, len(self.pending)), 0, -1)
                     if self.stop.startswith(self.pending[-n:])), 0)
        self._emit(self.pending[: len(self.pending) - keep])
        self.pending = self.pending[len(self.pending) - keep:]

    def flush(self) -> None:
        if not self.stopped:
            self._emit(self.pending)
        self.pending = ""

    def _emit(self, text: str) -> None:
        if text and self.sink is not None:
            self.sink(text)


def _streamer(tokenizer, on_text: Callable[[str], None], skip_prompt: bool, clock: dict):
    from sparsekit.runtime.streamer import TokenStreamer

    class _Streamer(TokenStreamer):
        def put(self, value):
            if not (self.skip_prompt and self.next_tokens_are_prompt) and "first" not in clock:
                clock["first"] = time.perf_counter()
            super().put(value)

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            on_text(text)

    return _Streamer(tokenizer, skip_prompt=skip_prompt, skip_special_tokens=True)


def fit_context(model: nn.Module, prompt_tokens: int, sampling: Sampling) -> Sampling:
    """``sampling`` with ``max_new_tokens`` cut so that prompt and reply fit the model's context
    (a ``SparsekitWarning`` says so); a prompt that fills the context is a one-line error."""
    from sparsekit.hf.models import model_context

    ctx = model_context(model)
    if not ctx:
        return sampling
    room = ctx - prompt_tokens
    if room < 1:
        raise SparsekitError(f"the prompt takes {prompt_tokens} tokens, the whole context of the model ({ctx}): "
                             "shorten it (or /reset the chat)")
    if sampling.max_new_tokens <= room:
        return sampling
    warnings.warn(f"--max-new-tokens {sampling.max_new_tokens} goes past the model's context of {ctx} tokens: "
                  f"at most {room} new tokens (the prompt takes {prompt_tokens})", SparsekitWarning, stacklevel=2)
    return replace(sampling, max_new_tokens=room)


@torch.no_grad()
def generate_ids(model: nn.Module, tokenizer, input_ids: torch.Tensor, sampling: Sampling, *,
                 on_text: Callable[[str], None] | None = None, engine: str = "auto",
                 stop: StopFilter | None = None) -> dict:
    """Continue ``input_ids`` ``[1, L]``: the new token ids, their text and timings (see module doc)."""
    requested, engine = engine, pick_engine(model, sampling, engine)
    dev = model_device(model)
    input_ids = input_ids.to(dev)
    sampling = fit_context(model, int(input_ids.shape[1]), sampling)
    sink = stop if stop is not None else on_text
    clock: dict = {}
    streamer = _streamer(tokenizer, sink or (lambda _t: None), engine == "hf", clock)
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    notes: list[str] = []
    start = time.perf_counter()
    try:
        if engine == "hf":
            new = _hf_generate(model, tokenizer, input_ids, sampling, streamer, stop)
        else:
            try:
                new = _static_generate(model, input_ids, sampling.max_new_tokens, eos_ids(model, tokenizer), streamer,
                                       stop, notes, clock)
            except _NoStaticDecoder as e:
                if requested == "static" or strict_mode():
                    raise SparsekitError(f"the static decoder cannot run this model: {e.__cause__}") from None
                notes.append(f"the static decoder cannot run this model ({e.__cause__}): decoding with transformers' "
                             "generate, slower")
                engine = "hf"
                streamer.skip_prompt = streamer.next_tokens_are_prompt = True
                new = _hf_generate(model, tokenizer, input_ids, sampling, streamer, stop)
    finally:  # also on Ctrl-C / SIGTERM: what was generated so far goes out
        streamer.end()
        if stop is not None:
            stop.flush()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    warmup = clock.get("warmup", 0.0)
    seconds = time.perf_counter() - start - warmup  # generation proper: compiling and graph capture apart
    text = tokenizer.decode(new, skip_special_tokens=True)
    if stop is not None and stop.stop and stop.stop in text:
        text = text[: text.index(stop.stop)]
    first = clock["first"] - start if "first" in clock else None
    n = len(new)
    after_first = seconds - first if first is not None else None
    return {"text": text, "token_ids": new, "prompt_tokens": int(input_ids.shape[1]), "new_tokens": n,
            "seconds": seconds, "tokens_per_s": n / seconds if seconds > 0 else None,
            "first_token_s": first, "warmup_s": warmup,
            "decode_tokens_per_s": (n - 1) / after_first if after_first and n > 1 and after_first > 0 else None,
            "engine": engine, "device": str(dev), "notes": notes}


def _hf_generate(model, tokenizer, input_ids, sampling: Sampling, streamer, stop: StopFilter | None) -> list[int]:
    kw: dict = {"max_new_tokens": sampling.max_new_tokens, "streamer": streamer,
                "attention_mask": torch.ones_like(input_ids)}
    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids(model, tokenizer)), None)
        if pad is not None:
            kw["pad_token_id"] = pad
    if sampling.greedy:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:  # the nucleus only: no top-k cut
        kw.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
    if stop is not None and stop.stop:
        kw.update(stop_strings=[stop.stop], tokenizer=tokenizer)
    out = model.generate(input_ids, **kw)
    return out[0, input_ids.shape[1]:].tolist()


class _NoStaticDecoder(Exception):
    """The static decoder could not be built or could not run the prompt (the cause is chained)."""


def _static_generate(model, input_ids, max_new: int, eos: set[int], streamer, stop: StopFilter | None,
                     notes: list[str], clock: dict) -> list[int]:
    """Greedy decoding on the runtime's decoder. ``clock["warmup"]``: the seconds the first decode step
    took to warm up and capture its CUDA graph (reported apart from the decoding speed)."""
    from sparsekit.runtime.cats import CatsActivation
    from sparsekit.runtime.decoder import GreedyDecoder

    try:  # batch 1: CATS MLPs take the activation-sparse kernels where they pay (numba only imported then)
        if any(isinstance(m, CatsActivation) for m in model.modules()):
            from sparsekit.runtime.cats_mlp import enable_cats_kernels

            if enable_cats_kernels(model):
                notes.append("CATS MLPs on the activation-sparse kernels")
    except Exception as e:  # noqa: BLE001 - the masked activation still works, and the note says so
        if strict_mode():
            raise
        notes.append(f"CATS kernels not used ({type(e).__name__}: {e}): the thresholds run as a masked activation")
    try:  # nothing is streamed yet: a model the decoder cannot take goes to transformers' generate
        dec = GreedyDecoder(model, 1, input_ids.shape[1] + max_new)
        tok = dec.prefill(input_ids)
    except Exception as e:  # noqa: BLE001 - the caller says so in one note (or raises when strict)
        raise _NoStaticDecoder() from e
    new: list[int] = []
    try:
        while True:
            t = int(tok[0, 0])
            new.append(t)
            streamer.put(tok[0].detach().cpu())
            if t in eos or len(new) >= max_new or (stop is not None and stop.stopped):
                return new
            if dec.use_graph and dec.graph is None:
                t0 = time.perf_counter()
                try:
                    dec.capture()
                except SparsekitError as e:
                    if dec.strict:
                        raise
                    dec.use_graph = False  # the CUDA graph could not be captured: the same step, eagerly
                    notes.append(f"{e}; decoding eagerly, slower")
                clock["warmup"] = time.perf_counter() - t0
            tok = dec.step()
    finally:
        notes.extend(n for n in dec.notes if n not in notes)


def generate_text(model: nn.Module, tokenizer, prompt: str, sampling: Sampling | None = None, *,
                  on_text: Callable[[str], None] | None = None, engine: str = "auto") -> dict:
    """Continue ``prompt`` (tokenized as the tokenizer does by default, BOS included)."""
    if not prompt or not prompt.strip():
        raise SparsekitError("the prompt is empty: pass some text, e.g. --prompt 'The capital of France is'")
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    return generate_ids(model, tokenizer, ids, sampling or Sampling(), on_text=on_text, engine=engine)


class Chat:
    """A conversation: ``send(text)`` adds the user turn, generates the reply and keeps both."""

    PLAIN_NOTE = ("the tokenizer has no chat template: the conversation goes to the model as plain "
                  "'User:'/'Assistant:' lines")

    def __init__(self, model: nn.Module, tokenizer, sampling: Sampling | None = None, *, engine: str = "auto"):
        self.model, self.tokenizer = model, tokenizer
        self.sampling = sampling or Sampling()
        self.engine = engine
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self.messages: list[dict[str, str]] = []

    def reset(self) -> None:
        self.messages = []

    def render(self) -> str:
        """The conversation so far, ending where the assistant's reply begins."""
        if self.templated:
            try:
                return self.tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)
            except Exception as e:
                raise SparsekitError(f"the tokenizer's chat template failed ({type(e).__name__}: {e})") from None
        lines = [f"{'User' if m['role'] == 'user' else 'Assistant'}: {m['content']}" for m in self.messages]
        return "\n".join(lines) + "\nAssistant:"

    def send(self, text: str, on_text: Callable[[str], None] | None = None) -> dict:
        if not text.strip():
            raise SparsekitError("the message is empty")
        self.messages.append({"role": "user", "content": text})
        rendered = self.render()
        # a template writes its own special tokens (BOS, ...); plain text gets the tokenizer's usual ones
        ids = self.tokenizer(rendered, return_tensors="pt", add_special_tokens=not self.templated).input_ids
        stop = None if self.templated else StopFilter(on_text, "\nUser:")
        try:
            result = generate_ids(self.model, self.tokenizer, ids, self.sampling, on_text=on_text,
                                  engine=self.engine, stop=stop)
        except BaseException:
            self.messages.pop()
            raise
        result["text"] = result["text"].strip() if not self.templated else result["text"]
        self.messages.append({"role": "assistant", "content": result["text"].strip()})
        return result


def settings_dict(sampling: Sampling) -> dict:
    return asdict(sampling)
