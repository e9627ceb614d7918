"""Continuous batching for the Python engine: libtinyloop's scheduler policy (api/sched.c)
over fallback.Engine's caches, an implementation of tinyloop.engine.EngineScheduler.

A request's `input` is its prompt followed by the tokens it emitted; its cache holds
input[:cache.length]. Admission (arrival order, while a slot is free and the blocks its prefill,
the other prefills and the decodes meanwhile will open fit the KV budget) looks the input up in
the prefix cache; a refused head is tried again once a request leaves or the held KV drops. A
running request is in its prefill phase until cache.length reaches `prefill_end` (it gets
prompt chunks from what the step's token budget leaves after one position per decoding
request; each chunk offers its full blocks to the prefix cache), then decodes one token a step,
or with n_draft > 0 runs one round of self-speculative decoding a step (docs/spec.md §5.6),
before the other requests, emitting its 1 .. K' tokens that step: the step is planned as
libtinyloop's (api/sched.c) plans it (_plan: K' fits the step's events and positions), and
admission and the budget count K' positions for a round. A step whose new blocks would pass the
budget preempts the newest running request: its cache is dropped and it waits at the head of
the queue to prefill its input again; a request with an exit rule (adaptive depth, docs/spec.md
§5.7) prefills (and looks up) only its prompt and replays its emitted tokens at the depths
they exited at, which it records, so its KV is again what it was. A step that fails preempts every running request, so a
retried step recomputes them exactly; it returns the events emitted before the failure (rounds
run first and emit as they go) and raises only when there are none, as libtinyloop's step does.
The reference runs each row on its own (batching changes no result, only speed), so every
request gets exactly Engine.generate's tokens.

KV bytes here are the Python pool's (blocks of one layer each, BlockPool.block_nbytes), so a
budget admits other schedules than the native one; the tokens are the same.
"""
import collections
import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tinyloop.engine import SCHED_STAT_NAMES, finish_reason

from .exit_rules import ForcedExit, exit_rule
from .forward import decode_adaptive, decode_pass, head_logits
from .kvcache import chunk_rows
from .sampling import NumericError
from .speculate import speculative_round


@dataclass(eq=False)
class _Request:
    id: int
    params: object               # tinyloop.engine.GenerationParams
    input: list                  # prompt ids, then the emitted ones
    n_prompt: int
    cache: object = None         # KVCache while running
    prefill_end: int = 0
    logits: np.ndarray = field(default=None, repr=False)
    round: int = 0               # this step's K' when it decodes speculatively (_plan), else 0
    rule: object = None          # its exit rule (fallback/exit_rules.py), None: full depth
    exits: list = field(default_factory=list)   # the iterations each decode pass ran (§5.7)
    depth: int = 0               # the iterations the pass giving `logits` ran for its token

    @property
    def emitted(self):
        return self.input[self.n_prompt:]


class Scheduler:
    def __init__(self, engine, max_batch, step_tokens, kv_budget_bytes):
        self.engine = engine
        self.max_batch, self.step_tokens, self.budget = max_batch, step_tokens, kv_budget_bytes
        self.waiting, self.running = deque(), []
        self._ids = itertools.count(1)
        self.counters = dict.fromkeys(SCHED_STAT_NAMES, 0)
        self._refused_at = None      # the held KV when the waiting head was refused
        self._stop_ids = engine.config.stop_token_ids()
        self._depths = collections.Counter()        # decode passes by the iterations they ran

    # -- KV accounting --------------------------------------------------------------------
    def _block_bytes(self, loops):
        return self.engine.config.n_layers(loops) * self.engine.pool.block_nbytes

    def _alone(self):
        """(blocks, bytes) the running requests hold alone (refs == 1), every layer."""
        blocks = sum(b is not None and b.refs == 1 for r in self.running
                     for layer in r.cache.layers for b in layer)
        return blocks, blocks * self.engine.pool.block_nbytes

    def _new_bytes(self, r, T):
        """Bytes of the blocks writing T positions at the end of r's cache would allocate or
        copy (a shared partial block is copied before its first write)."""
        cache, bs = r.cache, self.engine.pool.block_size
        n, fresh = cache.length, 0
        if T == 0:
            return 0
        for b in range(n // bs, (n + T - 1) // bs + 1):
            layer0 = cache.layers[0]
            fresh += b >= len(layer0) or layer0[b] is None or layer0[b].refs > 1
        return fresh * self._block_bytes(r.params.loops)

    # -- the EngineScheduler interface ----------------------------------------------------
    def add(self, prompt, params):
        if self.budget:
            positions = len(prompt) + params.max_tokens
            bs = self.engine.pool.block_size
            need = -(-positions // bs) * self._block_bytes(params.loops)
            if need > self.budget:
                raise ValueError(f"the request could need {need} bytes of KV ({positions} positions "
                                 f"at loops={params.loops}), more than kv_budget_bytes {self.budget}")
        r = _Request(next(self._ids), params, prompt.tolist(), len(prompt),
                     rule=exit_rule(params, self.engine.weights))
        self.waiting.append(r)
        return r.id

    def cancel(self, request_id):
        for queue in (self.running, self.waiting):
            for r in queue:
                if r.id == request_id:
                    queue.remove(r)
                    self._drop(r)
                    self.counters["cancelled"] += 1
                    self._refused_at = None
                    return True
        return False

    def step(self):
        self._admit()
        if not self.running:
            return []
        prefill_positions = self._fit_budget()
        events = []
        try:
            for r in [r for r in self.running if r.round]:
                self._speculate(r, events)
            ready = self._run(prefill_positions)
            events += [self._sample(r) for r in ready]
        except BaseException as failure:
            while self.running:
                self._preempt_newest()
            if not (events and isinstance(failure, Exception)):
                raise
        finally:
            self.counters["steps"] += 1
        return events

    def _run(self, budget):
        """The plain decodes, then prefill chunks of `budget` positions in all; returns the
        requests with logits to sample."""
        ready = [r for r in self.running if self._decoding(r) and not r.params.n_draft]
        for r in ready:
            self._decode(r)
        for r in [r for r in self.running if not self._decoding(r)]:
            if budget == 0:
                break
            T = self._chunk(r, budget)
            budget = max(0, budget - T)
            if self._prefill_chunk(r, T):
                ready.append(r)
        return ready

    def stats(self):
        counters = dict(self.counters, running=len(self.running), waiting=len(self.waiting),
                        kv_budget_bytes=self.budget)
        counters["kv_blocks"], counters["kv_bytes"] = self._alone()
        return counters

    def depth_counts(self):
        deepest = max(self._depths, default=0)
        return [self._depths[u] for u in range(1, deepest + 1)]

    def free(self):
        for r in itertools.chain(self.running, self.waiting):
            self._drop(r)
        self.running, self.waiting = [], deque()

    # -- the step's parts -----------------------------------------------------------------
    def _tree(self, r):
        return self.engine._tree(r.params)

    @staticmethod
    def _decoding(r):
        return r.cache.length >= r.prefill_end

    def _fits(self, r, used):
        """Whether r (looked up) fits beside `used`: its prefill's new blocks, the rest of the
        other prefills', and the decodes' until r's prefill is done."""
        if not self.budget or not self.running:
            return True
        prefilling = [q for q in self.running if not self._decoding(q)]
        decoding = [q for q in self.running if self._decoding(q)]
        positions = r.prefill_end - r.cache.length + sum(q.prefill_end - q.cache.length for q in prefilling)
        per_step = max(1, self.step_tokens - sum(self._width(q) for q in decoding))
        steps = -(-positions // per_step)
        need = (self._new_bytes(r, r.prefill_end - r.cache.length)
                + sum(self._new_bytes(q, q.prefill_end - q.cache.length) for q in prefilling)
                + sum(self._new_bytes(q, min(steps * self._width(q), q.params.max_tokens - len(q.emitted)))
                      for q in decoding))
        return used + need <= self.budget

    def _admit(self):
        used = self._alone()[1] if self.budget else 0
        if self._refused_at is not None and self.running and used >= self._refused_at:
            return
        self._refused_at = None
        pcache = self.engine.prefix_cache
        while self.waiting and len(self.running) < self.max_batch:
            r = self.waiting[0]
            r.cache = self.engine.new_cache(r.params.loops, r.params.cache_window,
                                            r.params.instruction_length)
            tokens = np.array(r.input[:self._shared_end(r)], np.int32)
            hit = pcache.lookup(self._tree(r), r.cache, tokens) if pcache is not None else 0
            r.prefill_end = len(r.input) - (r.rule is not None and len(r.emitted) > 0)
            if not self._fits(r, used):     # admitting allocates no block: `used` holds
                self._drop(r)
                self._refused_at = used
                break
            del r.exits[r.prefill_end - r.n_prompt:]   # a pass whose token was not sampled
            self.counters["cached_tokens"] += hit
            self.running.append(self.waiting.popleft())

    @staticmethod
    def _chunk(r, budget):
        """The positions of r's next prefill chunk, out of `budget` left: the instruction block
        whole when it starts at position 0, even past the budget (docs/spec.md §5.5 step 4)."""
        return chunk_rows(r.cache.length, budget, r.prefill_end - r.cache.length,
                          r.cache.instruction)

    @staticmethod
    def _width(r):
        """Positions one decode step of r computes at most: a round's n_draft, else 1."""
        return r.params.n_draft or 1

    def _plan(self):
        """Plan the step as it runs. In running order each decoding request takes its
        positions: one, or for a speculative one its round's K' (r.round) = min(n_draft, tokens
        left, room), the room being what the step's positions (step_tokens, which also bounds
        the events NativeScheduler takes) have left once every running request not planned
        yet keeps one. Then the prefills, in order, take chunks of the
        positions left. Returns (bytes of the new blocks the step would allocate, positions
        left to the prefills)."""
        limit = self.step_tokens                            # >= max_batch >= len(self.running)
        need = used = 0
        unplanned = len(self.running)
        for r in self.running:
            r.round = 0
            if not self._decoding(r):
                continue
            unplanned -= 1
            T = 1
            if r.params.n_draft:
                T = r.round = min(r.params.n_draft, r.params.max_tokens - len(r.emitted),
                                  limit - used - unplanned)
            need += self._new_bytes(r, T)
            used += T
        budget = left = self.step_tokens - used
        for r in self.running:
            if not self._decoding(r) and budget:
                T = self._chunk(r, budget)
                need += self._new_bytes(r, T)
                budget = max(0, budget - T)
        return need, left

    def _preempt_newest(self):
        victim = self.running.pop()
        self._drop(victim)
        self.waiting.appendleft(victim)
        self.counters["preemptions"] += 1
        self._refused_at = None

    def _fit_budget(self):
        """Plan the step, preempting the newest running requests until it fits the KV budget
        (never the last one). Returns the positions the plan leaves to the prefills."""
        while True:
            need, left = self._plan()
            if not self.budget or len(self.running) == 1 or self._alone()[1] + need <= self.budget:
                return left
            self._preempt_newest()

    def _decode(self, r):
        e = self.engine
        x, depth = decode_pass(e.kernels, e.weights, r.cache, r.input[-1], r.rule)
        r.exits.append(depth)
        r.depth = depth
        r.cache.release_outside_window()
        r.logits = head_logits(e.kernels, e.weights, x)[0]

    @staticmethod
    def _shared_end(r):
        """How much of r's input the prefix cache may see: its prompt under an exit rule
        (decoded positions are not depth-complete, docs/spec.md §5.7), else all of it."""
        return r.n_prompt if r.rule is not None else len(r.input)

    def _prefill_chunk(self, r, T):
        """Run T more input positions: prompt positions as a prefill chunk, emitted ones of an
        adaptive request as replays of their recorded exits (docs/spec.md §5.7). True when that
        ends r's prefill phase with logits to sample."""
        e, start = self.engine, r.cache.length
        pcache = e.prefix_cache
        fresh = min(T, self._shared_end(r) - start)
        if fresh > 0:
            logits = e.prefill(r.cache, np.array(r.input[start:start + fresh], np.int32), fresh,
                               release=pcache is None)
            self.counters["prompt_tokens"] += fresh
            if pcache is not None:
                pcache.insert(self._tree(r), r.cache,
                              np.array(r.input[:min(r.cache.length, self._shared_end(r))], np.int32))
        for pos in range(start + max(fresh, 0), start + T):
            depth = r.exits[pos - r.n_prompt]
            decode_adaptive(e.kernels, e.weights, r.cache, r.input[pos], lambda _: ForcedExit(depth))
            self.counters["prompt_tokens"] += 1
        if r.cache.length < r.prefill_end:
            return False
        r.cache.release_outside_window()
        if r.prefill_end < len(r.input):         # an adaptive request's replay: its last token
            return False                         # decodes next step
        r.logits, r.depth = logits, r.params.loops
        return True

    def _speculate(self, r, events):
        """r's round of K' = r.round positions, its events appended to `events` as they are
        emitted, so none is lost if the round then fails (a NumericError ends r with an
        "error" event, as _sample does)."""
        def emit(token, logits):
            r.input.append(token)
            self.counters["generated_tokens"] += 1
            events.append((r.id, token, finish_reason(r.emitted, r.params, self._stop_ids)))
            return events[-1][2] is not None

        e = self.engine
        try:
            drafted, accepted = speculative_round(e.kernels, e.weights, r.cache, r.input, r.params,
                                                  emit, r.round)
        except NumericError:
            events.append((r.id, -1, "error"))
        else:
            self.counters["drafted_tokens"] += drafted
            self.counters["accepted_tokens"] += accepted
        if events[-1][2] is not None:
            self._finish(r)

    def _sample(self, r):
        """r's next token as an event; a finished request leaves."""
        history = r.input
        try:
            token = self.engine.kernels.sample(r.logits, history, r.params, len(history))
        except NumericError:
            self._finish(r)
            return (r.id, -1, "error")
        r.input.append(token)
        self.counters["generated_tokens"] += 1
        if len(r.emitted) > 1 and not r.params.n_draft:   # after a pass over an emitted token
            self.counters["decode_passes"] += 1
            self.counters["decode_loops"] += r.depth
            self._depths[r.depth] += 1
        why = finish_reason(r.emitted, r.params, self._stop_ids)
        if why is not None:
            self._finish(r)
        return (r.id, token, why)

    def _finish(self, r):
        self.running.remove(r)
        self._drop(r)
        self.counters["finished"] += 1
        self._refused_at = None

    @staticmethod
    def _drop(r):
        if r.cache is not None:
            r.cache.free()
            r.cache = None
