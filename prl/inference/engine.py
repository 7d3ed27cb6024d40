"""The embedded inference engine core: continuous batching on Hugging Face model classes.

Rules this module guarantees:
- requests join and leave between decode steps; nobody waits for the longest member of a batch;
- every generated token carries the policy version of the weights that produced it;
- a new policy is applied between two decode steps, whole: `stage_weights` takes an already
  validated state dict, and `step` copies it in before the next forward; running requests keep
  their KV cache and continue under the new weights;
- KV is reused only under the version that computed it (cache salt = version): a prompt reuses the
  longest prefix (prompt and generated tokens of earlier requests, `prl.inference.prefix_cache`)
  computed under the version it starts under, and computes only the rest; a sequence whose KV spans a
  weight load is never kept for reuse.

`EngineCore` is synchronous and single-threaded; `prl.inference.loop.EngineLoop` runs it on a
thread and `prl.inference.server` puts HTTP in front of it.
Prompts computed whole that join in the same step share one left-padded forward (`_prefill_batch`),
with up to PREFILL_BATCH in all when prompts still waiting are computed ahead in it (`_ahead`); a prompt
that reuses more than a short prefix (SHORT_HIT), feeds the KV pool or captures routing runs alone.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from prl.inference.kv_pool import fill_cache
from prl.inference.kvcache import BatchCache, cache_row, clone_cache, narrow_cache
from prl.inference.prefix_cache import Entry, Hit, PrefixCache
from prl.model import mla
from prl.model.lean_forward import forward_for as lean_forward_for
from prl.model.weights import nonfinite_names

PREFILL_BATCH = 4  # prompts one prefill forward computes at most when some are computed ahead (`_ahead`)
LOOKAHEAD = 64  # waiting requests `_ahead` looks at
SHORT_HIT = 16  # a hit this short on an entry the prompt does not extend is recomputed in a shared forward
SCORE_TOKENS = 16384  # padded tokens one /score forward holds at most (its logits are tokens x vocabulary)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass
class Sequence:
    """One request: its prompt, what it generated, and where it stands in the batch."""

    prompt_ids: list[int]
    params: SamplingParams
    on_done: Callable[["Sequence"], None] | None = None
    id: int = field(default_factory=itertools.count().__next__)
    out_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    length: int = 0  # real tokens in the KV cache
    pending: int = -1  # sampled token not yet fed to the model
    generator: torch.Generator | None = None
    arrived_at_step: int = -1  # the engine's decode steps when it was added
    admitted_at_step: int = -1
    aborted: bool = False  # its client went away: dropped at the next step
    prefill_only: bool = False  # P/D: compute the prompt's KV into the pool, generate nothing
    pooled: tuple[int, int] = (0, 0)  # (weights version, prompt tokens) its prefill left in the KV pool
    prompt_routing: torch.Tensor | None = None  # [prompt tokens, MoE layers, k] when capturing
    routing_chunks: list[torch.Tensor] = field(default_factory=list)  # one [1, layers, k] per decode input
    kv_version: int | None = None  # the weights version its prefill ran under
    prefix_entry: Entry | None = None  # the prefix-cache entry its KV extends (replaced when it finishes)
    final: bool = False  # no later request extends it: its KV is not kept when it finishes

    def completion_routing(self) -> torch.Tensor | None:
        """Routing of the completion tokens fed back as inputs (all but the last)."""
        if self.prompt_routing is None:
            return None
        if not self.routing_chunks:
            return self.prompt_routing[:0]
        return torch.cat(self.routing_chunks)


@dataclass
class EngineStats:
    steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually computed (not from the prefix cache or the KV pool)
    prefix_hits: int = 0  # prefills that reused KV from the local prefix cache (any length)
    prefix_hit_tokens: int = 0  # prompt tokens whose KV came from the local prefix cache
    weight_loads: int = 0
    busy_s: float = 0.0
    batched_prefills: int = 0  # forwards that computed several prompts at once
    prefill_forwards: int = 0  # forwards that computed prompt tokens (batched or not)
    prefilled_ahead: int = 0  # prompts computed while they still waited (`_ahead`)


class EngineCore:
    def __init__(self, model, max_batch_size: int = 64, prefix_cache_entries: int = 256, seed: int = 0,
                 capture_routing: bool = False, pool=None, prefix_cache_tokens: int | None = None,
                 kv_capacity_tokens: int = 0, compiled: bool = False, latent_decode: bool = True,
                 prefill_wait_steps: int = 0, lean: bool = True):
        self.model = model.eval()
        if latent_decode:  # MLA (GLM-5): decode steps attend in the latent space, nothing re-expanded
            mla.install(model)
        # every forward through torch.compile (shapes change with the batch, the prompt and the KV width:
        # compiled with dynamic shapes). Parameters are graph inputs, so weights copied in by a load
        # take effect at the next step as they do eagerly.
        self.forward = torch.compile(model, dynamic=True) if compiled else model
        # eager forwards without transformers' per-call machinery, where the family has one (Qwen3-MoE)
        self.lean = lean_forward_for(model) if lean and not compiled else None
        self.pool = pool  # prl.inference.kv_pool.KvPool: prompt KV shared with the run's other servers
        self.template = None  # an empty cache of this model's layer types (from the first prefill)
        self.device = next(model.parameters()).device  # inputs go there; sampling runs on the CPU
        self.cache_kw = cache_kwarg(model)
        self.capture = None
        if capture_routing:
            if compiled:
                raise ValueError("the embedded engine captures routing (R3) only in eager forwards")
            from prl.model.routing import Capture

            self.capture = Capture(model)
        self.max_batch_size = max_batch_size
        self.kv_capacity_tokens = kv_capacity_tokens  # token slots of the batch's KV cache (0: unbounded)
        self.prefill_wait_steps = prefill_wait_steps  # see `_defer_prefill`
        self.prefix_cache_entries = prefix_cache_entries
        self.version = -1  # no policy loaded yet: random init
        self.stats = EngineStats()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.batch = BatchCache()
        self.prefix = PrefixCache(prefix_cache_entries, prefix_cache_tokens)  # entries, and tokens held (None: any)
        self.rng = torch.Generator().manual_seed(seed)
        self._lock = threading.Lock()
        self._staged: tuple[Policy, threading.Event] | None = None

    # ---- called from any thread ----
    def add(self, seq: Sequence) -> None:
        with self._lock:
            seq.arrived_at_step = self.stats.steps
            self.waiting.append(seq)

    def stage_weights(self, policy: "Policy") -> threading.Event:
        """Queue a validated policy; the returned event is set once it serves."""
        done = threading.Event()
        with self._lock:
            self._staged = (policy, done)
        return done

    def abort(self, seq: Sequence) -> None:
        """Stop `seq` (from any thread): a waiting one is removed now, a running one leaves the batch
        at the next step with finish_reason "abort"."""
        with self._lock:
            seq.aborted = True
            if seq in self.waiting:
                self.waiting.remove(seq)

    def reserved_tokens(self, *extra: Sequence) -> int:
        """Token slots the running batch's KV cache can reach: its rows are padded to the longest, so
        rows x the longest prompt + max_tokens among them (with `extra` admitted, if given). There is
        no preemption: a request is admitted only if this stays within the capacity."""
        seqs = [*self.running, *extra]
        return len(seqs) * max((len(s.prompt_ids) + s.params.max_tokens for s in seqs), default=0)

    def kv_usage(self) -> float | None:
        """Reserved token slots over the capacity; None when the capacity is unbounded."""
        return self.reserved_tokens() / self.kv_capacity_tokens if self.kv_capacity_tokens else None

    def room_for(self, seq: Sequence, joining: list[Sequence] = ()) -> bool:
        """Whether admitting `seq` (with `joining`, admitted this step) keeps the batch within the KV
        capacity (one request alone always fits)."""
        if not self.kv_capacity_tokens or not (self.running or joining):
            return True
        return self.reserved_tokens(*joining, seq) <= self.kv_capacity_tokens

    @torch.no_grad()
    def warm_up(self) -> None:
        """Run a few greedy requests so that a compiled model compiles now, not on the first client's
        request: a batched prefill, a single one, ones after a reused prefix (of one token and of more:
        the compiler specialises size 1), decode steps of several rows and of one. Leaves no trace: no
        prefix-cache entry, no counted token. Shapes it did not cover compile when first met (the
        tiny GLM-5 model, whose DSA layers guard on more, recompiled for about 80 s in its first
        minutes of serving, measured)."""
        if self.forward is self.model:
            return
        rng = self.rng.get_state()
        greedy = [Sequence([1 + i % 3 for i in range(n + 3)], SamplingParams(temperature=0.0, max_tokens=n))
                  for n in (4, 3, 2)]
        for seq in greedy:
            self.add(seq)
        self._drain()
        first = greedy[0]
        self.add(Sequence(first.prompt_ids + first.out_ids + [1], SamplingParams(temperature=0.0, max_tokens=2)))
        self._drain()
        self.add(Sequence([2, 1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2)))
        self._drain()
        self.add(Sequence([2, 3, 3], SamplingParams(temperature=0.0, max_tokens=2)))  # a one-token prefix hit
        self._drain()
        self.prefix.clear()
        self.stats = EngineStats()
        self.rng.set_state(rng)

    def _drain(self) -> None:
        while self.running or self.waiting:
            self.step()

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._staged)

    def has_staged(self) -> bool:
        return self._staged is not None

    # ---- the engine thread ----
    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """One iteration: apply staged weights, admit waiting requests, decode one token for all."""
        t0 = time.perf_counter()
        self.apply_staged()
        finished = self._drop_aborted()
        finished += self._admit()
        if self.running:
            finished += self._decode()
            self.stats.steps += 1
        self.stats.busy_s += time.perf_counter() - t0
        for seq in finished:
            seq.prefix_entry = None  # do not pin an entry's KV beyond the request
            if seq.on_done:
                seq.on_done(seq)
        return finished

    @torch.no_grad()
    def apply_staged(self) -> None:
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is None:
            return
        policy, done = staged
        policy.load_into(self.model)
        self.version = policy.version
        self.prefix.clear()  # salt: no prefix computed under an older version is reused
        self.stats.weight_loads += 1
        done.set()

    def _drop_aborted(self) -> list[Sequence]:
        gone = [s for s in self.running if s.aborted]
        if gone:
            keep = [i for i, s in enumerate(self.running) if not s.aborted]
            self.batch.keep(keep)
            self.running = [self.running[i] for i in keep]
            for s in gone:
                s.finish_reason = "abort"
        return gone

    def _admit(self) -> list[Sequence]:
        """Prefill the requests joining this step (those computed from scratch in one forward where
        they can share it), sample each one's first token in one draw, and add the rows that go on to
        the batch in one copy."""
        finished, started = [], []
        seqs = self._take_waiting()
        batched = self._prefill_batch(*self._batchable(seqs))
        for seq in seqs:
            cache, logits = batched.pop(seq.id, None) or self._prefill(seq)
            seq.admitted_at_step = self.stats.steps
            if seq.prefill_only:  # its KV went to the pool; a decode server continues it
                seq.finish_reason = "prefill"
                finished.append(seq)
            else:
                started.append((seq, cache, logits))
        if not started:
            return finished
        tokens, logprobs = self._sample(torch.stack([lg for _, _, lg in started]), [s for s, _, _ in started])
        joining = []
        for (seq, cache, _), tok, lp in zip(started, tokens, logprobs):
            self._emit(seq, tok, lp)
            if seq.finish_reason:
                finished.append(seq)
            else:
                joining.append((cache, seq.length))
                self.running.append(seq)
        self.batch.add_rows(joining)  # the batch's rows stay in `running`'s order
        return finished

    def _take_waiting(self) -> list[Sequence]:
        """The waiting requests that join this step, in order, while the batch and its KV capacity allow
        (a request that does not fit waits for running ones to finish); none while `_defer_prefill`."""
        seqs: list[Sequence] = []
        if self._defer_prefill():
            return seqs
        with self._lock:
            while self.waiting and len(self.running) + len(seqs) < self.max_batch_size:
                if not self.room_for(self.waiting[0], joining=seqs):
                    break
                seqs.append(self.waiting.popleft())
        return seqs

    def _defer_prefill(self) -> bool:
        """Whether the waiting requests wait for more to share their prefill forward: while a batch
        decodes, until PREFILL_BATCH distinct prompts wait or the oldest has waited
        `prefill_wait_steps` decode steps. In an async RL run groups arrive one by one as
        others finish, each paying a prefill forward of its own, which costs about what a forward of
        several does. Never with an empty batch (nothing would run), nor where prompts cannot share a
        forward (routing capture, the KV pool)."""
        if not (self.prefill_wait_steps and self.running and self.waiting) or self.capture is not None \
                or self.pool is not None or len(self.running) >= self.max_batch_size:
            return False
        with self._lock:  # what other threads change; the prefix cache is the engine thread's own
            waiting = list(itertools.islice(self.waiting, LOOKAHEAD))
        if not waiting or self.stats.steps - waiting[0].arrived_at_step >= self.prefill_wait_steps:
            return False  # waited enough
        if not self._recomputed(waiting[0], set()):
            return False  # a conversation's next turn (its own forward after its history), or cached
        return len({tuple(s.prompt_ids) for s in waiting}) < PREFILL_BATCH

    def _batchable(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """Those that can share one forward computing their whole prompt (`_recomputed`), the first of
        any identical prompts (the others then hit its prefix entry); and, when there are such, waiting
        requests to compute ahead in the same forward (`_ahead`). ([], []) unless two prompts or more
        share it, or where the KV pool or routing capture must be fed."""
        if self.capture is not None or self.pool is not None:
            return [], []
        seen: set = set()
        out = [s for s in seqs if self._recomputed(s, seen)]
        room = min(PREFILL_BATCH, self.prefix.max_entries - 1) - len(out)  # entries it fills stay till used
        ahead = self._ahead(room, seen, max(len(s.prompt_ids) for s in out)) if out and not self._staged else []
        return (out, ahead) if len(out) + len(ahead) > 1 else ([], [])

    def _recomputed(self, s: Sequence, seen: set) -> bool:
        """Whether `s`'s prompt, not met before in `seen` (which learns it), is best computed whole in a
        shared forward: no prefix entry covers more than its first SHORT_HIT tokens unless the prompt
        extends it whole (a task's common instruction, "rev:" and a letter, is recomputed, as that costs
        a shared forward little next to a forward of its own; a conversation's earlier turns are
        reused), and none knows its last logits (it costs no forward at all). The probe leaves the
        entry's place in the eviction order: `_prefill` looks up again what it reuses."""
        ids = tuple(s.prompt_ids)
        if s.prefill_only or ids in seen:
            return False
        seen.add(ids)
        hit = self.prefix.lookup(self.version, ids, touch=False)
        return hit is None or (hit.logits is None and hit.tokens <= SHORT_HIT and hit.shared < len(hit.entry.ids))

    def _ahead(self, room: int, seen: set, width: int) -> list[Sequence]:
        """Up to `room` requests still waiting (behind a full batch or the KV capacity) whose prompts
        `_recomputed` takes: their prefill shares the forward of those joining now, and their KV and
        last logits wait in the prefix cache, so that joining later costs them no forward. A prefill
        forward costs about the same for one short prompt as for several (reverse-tiny's model: 3.2 ms
        for one, 4.6 ms for four; a decode step of 120 rows 6.9 ms), and a full batch frees room for
        one group at a time, each group's first member paying a forward of its own. Only prompts of
        half the forward's `width` (its longest joining prompt) to all of it: the forward's cost is rows
        x width, and its peak memory is not in the KV capacity."""
        if room <= 0:
            return []
        with self._lock:  # what other threads change; the prefix cache is the engine thread's own
            waiting = list(itertools.islice(self.waiting, LOOKAHEAD))
        out: list[Sequence] = []
        for s in waiting:
            if len(out) >= room:
                break
            if width // 2 <= len(s.prompt_ids) <= width and self._recomputed(s, seen):
                out.append(s)
        return out

    def _prefill_batch(self, joining: list[Sequence], ahead: list[Sequence]) -> dict[int, tuple[object, torch.Tensor]]:
        """One forward over several prompts, left-padded (rows right-aligned, as the batch cache holds
        them): the cache and last logits of each joining prompt; every prompt (those computed ahead
        too) remembered in the prefix cache as a single prefill's."""
        seqs = [*joining, *ahead]
        if not seqs:
            return {}
        lengths = [len(s.prompt_ids) for s in seqs]
        width = max(lengths)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, (s, n) in enumerate(zip(seqs, lengths)):
            ids[i, width - n:] = torch.tensor(s.prompt_ids)
            mask[i, width - n:] = 1
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        logits, cache = self._forward(ids.to(self.device), pos.to(self.device), None, mask)
        logits = logits[:, -1].float().cpu()
        result = {}
        for i, (s, n) in enumerate(zip(seqs, lengths)):
            row = cache_row(cache, i, n)
            if self.template is None:
                self.template = empty_like_cache(row)
            self.stats.prefill_tokens += n
            if i >= len(joining):  # joins later on this entry (counted as computed here, not as a hit then)
                entry = self.prefix.insert(self.version, tuple(s.prompt_ids), clone_cache(row), None, {n: logits[i]})
                if entry is not None:
                    entry.ahead = True
                continue
            s.length, s.kv_version, s.prompt_routing = n, self.version, None
            self.stats.prompt_tokens += n
            self._remember_prompt(s, tuple(s.prompt_ids), row, logits[i], 0, None)
            result[s.id] = (row, logits[i])
        self.stats.batched_prefills += 1
        self.stats.prefill_forwards += 1
        self.stats.prefilled_ahead += len(ahead)
        return result

    def _prefill(self, seq: Sequence):
        """KV cache and last-position logits for the prompt: the longest prefix that the prefix cache
        (or, when longer, the KV pool) holds under this version is reused, only the rest computed."""
        seq.length, seq.kv_version = len(seq.prompt_ids), self.version
        self.stats.prompt_tokens += seq.length
        ids = tuple(seq.prompt_ids)
        hit = None if seq.prefill_only else self.prefix.lookup(self.version, ids)  # prefill-only: all for the pool
        if hit is not None and hit.logits is not None:  # the whole prompt, with its last logits
            if hit.entry.ahead:  # computed ahead for this very request: its prefill, counted then
                hit.entry.ahead = False
            else:
                self._count_hit(hit.tokens)
            seq.prompt_routing = None if hit.entry.routing is None else hit.entry.routing[: seq.length]
            seq.prefix_entry = hit.entry if len(hit.entry.ids) == seq.length else None
            return narrow_cache(hit.entry.cache, seq.length), hit.logits
        done, cache, before, pooled = self._start(seq.prompt_ids, hit)
        if done and not pooled:
            self._count_hit(done)
        logits, cache, seq.prompt_routing = self._forward_prompt(seq.prompt_ids, done, cache, before)
        self.stats.prefill_forwards += 1
        logits = logits[0, -1].float().cpu()
        self.stats.prefill_tokens += seq.length - done
        offered = self._put_in_pool(seq, cache, pooled, hit if done and not pooled else None)
        self._remember_prompt(seq, ids, cache, logits, offered, hit)
        return cache, logits

    def _count_hit(self, tokens: int) -> None:
        self.stats.prefix_hits += 1
        self.stats.prefix_hit_tokens += tokens

    def _start(self, prompt: list[int], hit: Hit | None):
        """Where the prompt's forward starts: (tokens reused, their cache, their routing, KV-pool chunks
        used). The pool is asked only when its full chunks could cover more than the local hit; the
        chunks it gives, once read, are used unless the local hit is longer."""
        done = hit.tokens if hit is not None else 0
        if done and self.capture is not None and hit.entry.routing is None:
            done = 0  # cannot give the prefix's routing (R3): compute it
        local = (done, narrow_cache(hit.entry.cache, done) if done else None,
                 hit.entry.routing[:done] if done and hit.entry.routing is not None else None, 0)
        if self.pool is None or self.template is None or (len(prompt) - 1) // self.pool.chunk * self.pool.chunk <= done:
            return local
        chunks = self.pool.fetch(self.version, prompt)
        if not chunks or len(chunks) * self.pool.chunk < done:
            return local
        cache, routing = fill_cache(self.template, chunks, self.device)
        if self.capture is not None and routing is None:
            return local  # pooled by a server that did not capture routing
        self.pool.stats.hit_tokens += len(chunks) * self.pool.chunk
        return len(chunks) * self.pool.chunk, cache, routing, len(chunks)

    def _forward_prompt(self, prompt: list[int], done: int, cache, before: torch.Tensor | None):
        """The forward of `prompt[done:]` after `cache` (the KV of `prompt[:done]`, whose routing is
        `before`): its logits, the whole prompt's cache and the whole prompt's routing."""
        ids = torch.tensor([prompt[done:]], device=self.device)
        pos = torch.arange(done, len(prompt), device=self.device)[None]
        logits, cache = self._forward(ids, pos, cache if done else None)
        if self.template is None:
            self.template = empty_like_cache(cache)
        routing = self.capture.take() if self.capture else None
        if routing is not None and done:
            routing = torch.cat([before, routing])
        return logits, cache, routing

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, cache, mask: torch.Tensor | None = None):
        """(logits [B, S, V], cache): `ids` [B, S] at positions `pos` after the P tokens `cache` holds
        (None: none), `mask` [B, P + S] True at real tokens (None: all real, one row); the lean forward
        where the family has one, else the model's."""
        if self.lean is not None:
            if mask is None:
                mask = torch.ones(1, int(pos[0, 0]) + ids.shape[1], dtype=torch.bool)
            return self.lean(ids, pos, cache, mask.bool())
        kw = {} if cache is None else {self.cache_kw: cache}
        if mask is not None:
            kw["attention_mask"] = mask.long().to(self.device)
        out = self.forward(input_ids=ids, position_ids=pos, use_cache=True, **kw)
        return out.logits, cache_of(out)

    @torch.no_grad()
    def score(self, items: list[tuple[list[int], int]], budget: int = SCORE_TOKENS) -> tuple[list[list[float]], int]:
        """For each (ids, start): the logprob of each of `ids[start:]` given the tokens before it, under the weights
        served now (temperature 1, whole vocabulary); and that version. The items run in forwards of at most
        `budget` padded tokens (one item at least), each padded on the right (masked: a sequence sees only its own
        tokens), no KV kept. Called on the engine thread between two steps (`EngineLoop.run`)."""
        out, batch = [], []
        for item in items:
            if batch and (len(batch) + 1) * max(len(ids) for ids, _ in [*batch, item]) > budget:
                out += self._score_batch(batch)
                batch = []
            batch.append(item)
        return out + self._score_batch(batch), self.version

    def _score_batch(self, items: list[tuple[list[int], int]]) -> list[list[float]]:
        width = max(len(ids) for ids, _ in items)
        x = torch.zeros(len(items), width, dtype=torch.long, device=self.device)
        mask = torch.zeros(len(items), width, dtype=torch.bool)
        for row, (ids, _) in enumerate(items):
            x[row, :len(ids)] = torch.tensor(ids)
            mask[row, :len(ids)] = True
        pos = torch.arange(width, device=self.device)[None].expand(len(items), -1)
        logits, _ = self._forward(x, pos, None, mask if len(items) > 1 else None)
        if self.capture is not None:
            self.capture.take()  # its routing is nobody's: the next prefill captures its own
        out = []
        for row, (ids, start) in enumerate(items):
            logp = torch.log_softmax(logits[row, start - 1:len(ids) - 1].float(), dim=-1)
            out.append(logp.gather(-1, x[row, start:len(ids), None])[:, 0].cpu().tolist())
        return out

    def _put_in_pool(self, seq: Sequence, cache, pooled: int, local: Hit | None) -> int:
        """Offer the prompt's full chunks to the KV pool, but those it came with (from the pool, or
        from a local entry that offered them already); the prompt tokens now offered."""
        if self.pool is None:
            return 0
        chunk = self.pool.chunk
        skip = max(pooled, min(local.tokens, local.entry.pooled) // chunk if local else 0)
        stored = self.pool.put(self.version, seq.prompt_ids, cache, seq.prompt_routing, skip=skip,
                               wait=seq.prefill_only)
        loadable = (seq.length - 1) // chunk  # a lookup leaves the last token to compute
        seq.pooled = (self.version, min(stored, loadable) * chunk)
        return seq.length // chunk * chunk if self.pool.usable() else skip * chunk

    def _remember_prompt(self, seq: Sequence, ids: tuple[int, ...], cache, logits, offered: int,
                         hit: Hit | None) -> None:
        """Keep the prompt's KV and last logits; an entry it wholly extends goes. When an entry already
        holds the whole prompt (only its last token was computed), it just learns the logits."""
        if hit is not None and hit.shared >= len(ids):
            self.prefix.add_logits(hit.entry, len(ids), logits)
            seq.prefix_entry = hit.entry if len(hit.entry.ids) == len(ids) else None
            return
        extends = hit.entry if hit is not None and hit.tokens == len(hit.entry.ids) else None
        seq.prefix_entry = self.prefix.insert(self.version, ids, clone_cache(cache), seq.prompt_routing,
                                              {len(ids): logits}, pooled=offered, replaces=extends)

    def _decode(self) -> list[Sequence]:
        ids = torch.tensor([[s.pending] for s in self.running], device=self.device)
        pos = torch.tensor([[s.length] for s in self.running], device=self.device)
        logits, self.batch.cache = self._forward(ids, pos, self.batch.cache, self.batch.step_mask())
        self.batch.advance()
        routing = self.capture.take() if self.capture else None
        for i, s in enumerate(self.running):
            s.length += 1
            if routing is not None:
                s.routing_chunks.append(routing[i : i + 1])
        tokens, logprobs = self._sample(logits[:, -1].float().cpu(), self.running)
        for s, tok, lp in zip(self.running, tokens, logprobs):
            self._emit(s, tok, lp)
        keep = [i for i, s in enumerate(self.running) if not s.finish_reason]
        finished = [s for s in self.running if s.finish_reason]
        if finished:
            self._remember_finished([i for i, s in enumerate(self.running) if s.finish_reason])
            self.batch.keep(keep)
            self.running = [self.running[i] for i in keep]
        return finished

    def _remember_finished(self, rows: list[int]) -> None:
        """Keep the KV of finished sequences (prompt and generated tokens, all but the last sampled one,
        never fed back) for a next turn to extend; each replaces the entry its KV extended. A sequence
        whose KV spans a weight load is not kept: its prefix was computed under an older version; nor is one
        its client marked final (nothing will extend it)."""
        if self.prefix.max_entries <= 0:
            return
        for i in rows:
            s = self.running[i]
            if s.kv_version != self.version or s.final:
                continue
            ids = tuple(s.prompt_ids) + tuple(s.out_ids[: s.length - len(s.prompt_ids)])
            routing = None if s.prompt_routing is None else torch.cat([s.prompt_routing, s.completion_routing()])
            prev = s.prefix_entry
            self.prefix.insert(self.version, ids, self.batch.row(i, s.length), routing,
                               pooled=prev.pooled if prev is not None else 0, replaces=prev)

    def _emit(self, seq: Sequence, tok: int, lp: float) -> None:
        seq.out_ids.append(tok)
        seq.logprobs.append(lp)
        seq.versions.append(self.version)
        seq.pending = tok
        self.stats.generated_tokens += 1
        if tok in seq.params.stop_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.out_ids) >= seq.params.max_tokens:
            seq.finish_reason = "length"

    def _sample(self, logits_BV: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
        return sample(logits_BV, [s.params for s in seqs], [s.generator or self.rng for s in seqs])


def cache_kwarg(model) -> str:
    """transformers renamed the forward's `past_key_values` to `cache` (5.2x); speak both."""
    import inspect

    return "past_key_values" if "past_key_values" in inspect.signature(model.forward).parameters else "cache"


def empty_like_cache(cache):
    """A cache with `cache`'s layer objects and no tokens (the KV pool fills copies of it)."""
    from prl.inference.kvcache import layer_tensors

    empty = clone_cache(cache)
    for layer in empty.layers:
        for attr, dim in layer_tensors(layer):
            t = getattr(layer, attr)
            setattr(layer, attr, t.narrow(dim % t.dim(), 0, 0))
    return empty


def cache_of(out):
    cache = getattr(out, "past_key_values", None)
    return cache if cache is not None else out.cache


def sample(logits_BV: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator]):
    """Sample one token per row. The logprob returned is that of the token under the
    temperature-scaled distribution before top-p truncation, the one the trainer recomputes."""
    temps = torch.tensor([p.temperature for p in params])
    greedy = temps == 0
    logp_BV = torch.log_softmax(logits_BV / torch.where(greedy, 1.0, temps)[:, None], -1)
    probs_BV = logp_BV.exp()
    for i, p in enumerate(params):
        if p.top_p < 1.0 and not greedy[i]:
            probs_BV[i] = top_p_filter(probs_BV[i], p.top_p)
    if bool(greedy.all()):
        tok_B = logits_BV.argmax(-1)
    elif all(g is gens[0] for g in gens):
        tok_B = torch.multinomial(probs_BV, 1, generator=gens[0])[:, 0]
    else:
        tok_B = torch.cat([torch.multinomial(pr, 1, generator=g) for pr, g in zip(probs_BV, gens)])
    tok_B = torch.where(greedy, logits_BV.argmax(-1), tok_B)
    lp_B = logp_BV.gather(1, tok_B[:, None])[:, 0]
    return tok_B.tolist(), lp_B.tolist()


def top_p_filter(probs_V: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_p, order = probs_V.sort(descending=True)
    cut = (sorted_p.cumsum(-1) - sorted_p) >= top_p  # keep the smallest prefix reaching top_p
    sorted_p[cut] = 0.0
    return torch.zeros_like(probs_V).scatter(0, order, sorted_p)


def adapter_policy(model, raw: dict[str, torch.Tensor], version: int, where: str, form, base) -> Policy:
    """An adapter version (`form`, a `prl.model.policy.Version`) as the target weights it makes: `W_base + B' @ A`,
    each checked as a full version's."""
    expected = model.state_dict()
    problems = form.refusal(raw, {k: tuple(v.shape) for k, v in expected.items()})
    if problems or base is None:
        raise WeightLoadError(f"{where}: adapter refused: {problems[:3] or 'no base to merge into'}")
    try:
        state = with_base(model, base, form.base, form.merge(raw, base))
    except Exception as e:  # noqa: BLE001 - a missing or damaged base: refused, the old version serving
        raise WeightLoadError(f"{where}: adapter's base v{form.base}: {type(e).__name__}: {e}") from None
    return Policy({k: v.to(expected[k].dtype) for k, v in state.items()}, {}, version,
                  base=(form.base, frozenset(form.targets(raw))))


def with_base(model, base, version: int, merged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The merged targets, plus what the model needs besides to be base + adapter: the whole base where the
    model does not hold it (a server restarted mid-run, or serving another whole version), else the base's
    values of targets an earlier adapter changed and this one leaves out."""
    held = getattr(model, "prl_base", None)  # (base version, targets an adapter changed), set by `load_into`
    if held is None or held[0] != version:
        return {**base.whole(version), **merged}
    stale = set(held[1]) - set(merged)
    return {**base.targets(version, stale), **merged} if stale else merged


class WeightLoadError(RuntimeError):
    """New weights were rejected before touching the served model; the old version keeps serving."""


@dataclass
class Policy:
    """A verified policy version: tensors matching the model, FP8 ones with their block scales."""

    state: dict[str, torch.Tensor]
    scales: dict[str, torch.Tensor]
    version: int
    base: tuple[int, frozenset] | None = None  # an adapter version: (its base, the targets it changes)

    @torch.no_grad()
    def load_into(self, model) -> None:
        """Copy into the model; FP8 linears take the published FP8 values as they are."""
        from prl.model.fp8 import BLOCK, Fp8BlockLinear, Quantized
        from prl.model.fp8_checkpoint import dequantize_entry

        modules = dict(model.named_modules())
        params = dict(model.named_parameters())
        params.update(model.named_buffers())
        for name, t in self.state.items():
            if name in self.scales:
                owner = modules.get(name.rsplit(".", 1)[0])
                if isinstance(owner, Fp8BlockLinear) and name.endswith(".weight"):
                    owner.load_quantized(Quantized(t, self.scales[name], (BLOCK, BLOCK)))
                    continue
                t = dequantize_entry(t, self.scales[name])
            params[name].copy_(t)
        model.prl_base = self.base or (self.version, frozenset())  # any whole version can be a LoRA base


def prepare_weights(model, path, base=None) -> Policy:
    """Read, verify and shape-check a published weight folder (plain or block-FP8).

    Runs off the engine thread, so decoding continues while a new policy is read."""
    from pathlib import Path

    from prl.model.weights import CorruptWeightsError, StreamedOnly, read_weights

    try:
        raw, manifest = read_weights(Path(path))
        version = int(manifest["version"])
    except StreamedOnly:
        raise
    except (CorruptWeightsError, OSError) as e:
        raise WeightLoadError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a bad header, a manifest without version: refused, not a 500
        raise WeightLoadError(f"{path}: unreadable weights ({type(e).__name__}: {e})") from None
    return make_policy(model, raw, version, str(path), manifest, base)


def make_policy(model, raw: dict[str, torch.Tensor], version: int, where: str, meta: dict | None = None,
                base=None) -> Policy:
    """A version's tensors as received (a folder's, or a collective's), checked against the model:
    every name, every shape, FP8 only with its scales, finite values. A LoRA adapter version (`meta`'s
    `adapter`) is merged into its base's weights (`base`, a `prl.model.lora.AdapterBase`)."""
    from prl.model.fp8_checkpoint import SCALE_SUFFIX
    from prl.model.policy import Version

    try:
        form = Version.of(meta or {})  # what the version holds: every weight, or adapters over a base
    except ValueError as e:
        raise WeightLoadError(f"{where}: adapter refused: {e}") from None
    if form.adapters:
        return adapter_policy(model, raw, version, where, form, base)

    scales = {k.removesuffix(SCALE_SUFFIX): v for k, v in raw.items() if k.endswith(SCALE_SUFFIX)}
    state = {k: v for k, v in raw.items() if not k.endswith(SCALE_SUFFIX)}
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted((set(state) - set(expected)) | (set(scales) - set(state)))
    bad = [k for k in expected.keys() & state.keys() if expected[k].shape != state[k].shape]
    unscaled = [k for k, v in state.items() if v.dtype == torch.float8_e4m3fn and k not in scales]
    if missing or extra or bad or unscaled:
        raise WeightLoadError(f"{where}: missing {missing[:5]}, unexpected {extra[:5]}, wrong shape {bad[:5]}, "
                              f"FP8 without scales {unscaled[:5]}")
    nonfinite = nonfinite_names(state)
    if nonfinite:
        raise WeightLoadError(f"{where}: non-finite values in {nonfinite[:5]}")
    state = {k: v if k in scales else v.to(expected[k].dtype) for k, v in state.items()}
    return Policy(state, scales, version)
