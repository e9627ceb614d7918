"""Self-speculative decoding (docs/spec.md §5.6): one round of draft, verify, emit and commit
on a sequence's KV cache, for any kernel set. The engine's generation loop and the scheduler
both decode through `speculative_round`; what they do with an emitted token (history, callbacks,
stop rules, events) is theirs, passed in as `emit`.

A round drafts K' tokens one row at a time at depth draft_loops (keeping each row's state after
its last iteration, and its injected term), verifies the K' rows in one pass resuming from those
states at the sequence's own depth, and emits the verifier's tokens while they equal the
drafts. Every emitted token and the logits it was sampled from are plain decoding's: the draft
decides only how many tokens a round emits. The KV of the positions it does not keep is
dropped (KVCache.truncate: block references only, nothing copied), and the window releases
blocks only at the committed length, as plain decoding does.
"""
import numpy as np

from .forward import forward_part, head_logits, stack_rows
from .sampling import NumericError


def draft_depth(params):
    """The round's draft depth: params.draft_loops, or for 0 (a wave request choosing its own,
    run here as rounds: docs/spec.md §5.6.1) a quarter of the loops, at least 1."""
    return params.draft_loops or max(params.loops // 4, 1)


def speculative_round(kernels, weights, cache, history, params, emit, limit):
    """One round on `cache`, which holds every position of `history` but the last, the token
    emitted last. Drafts K' = min(params.n_draft, limit) tokens (limit >= 1: the tokens the
    request may still emit, and the room its caller has), then samples the verifier's tokens
    v_1 .. with kernels.sample(logits, history, params, len(history)), calling emit(v_i,
    logits) for each: emit appends v_i to `history` and returns True when a stop rule fired.
    The round ends at the first stop, the first v_i that differs from its draft, or after K'.
    Returns (drafted, accepted): K' and the number of emitted tokens equal to their draft.

    A draft whose logits are not finite ends the drafting early (K' is then the rows drafted
    so far; that last row has no draft to accept). Whatever fails (the forward pass, the
    sampler, emit), the cache is left holding the positions committed so far."""
    p = cache.length
    depth = draft_depth(params)
    rows, drafts, states, injected = [history[-1]], [], [], []
    try:
        for i in range(min(params.n_draft, limit)):
            part = forward_part(kernels, weights, cache, p + i, np.array([rows[i]], np.int32),
                                depth=depth, coda_depth=params.loops)
            states.append(part.state)
            injected.append(part.injected)
            seen = history + drafts
            try:
                drafts.append(kernels.sample(head_logits(kernels, weights, part.hidden)[0], seen,
                                             params, len(seen)))
            except NumericError:
                drafts.append(None)
                break
            rows.append(drafts[-1])
        verified = forward_part(kernels, weights, cache, p, first_iter=depth,
                                state=stack_rows(kernels, states),
                                injected=None if injected[0] is None else stack_rows(kernels, injected))
        logits = head_logits(kernels, weights, verified.hidden)
        accepted = 0
        for z, draft in zip(logits, drafts):
            token = kernels.sample(z, history, params, len(history))
            p += 1                        # the row before `token` is committed with it
            accepted += token == draft
            if emit(token, z) or token != draft:
                break
        return len(drafts), accepted
    finally:
        cache.truncate(p)
        cache.release_outside_window()
