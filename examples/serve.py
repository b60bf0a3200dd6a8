"""Continuous batching on a paged K/V cache: requests of random prompt and output lengths
arrive over time and share every step, each step ONE call per layer.

The model: a small decoder of mhagen decoding layers, the rest plain numpy (float32):
    h = embed[tokens]
    h = h + attention_i(rmsnorm(h) * gain_i)        for each layer i (GQA, causal, rotary)
    hidden = rmsnorm(h) * gain_out                   (the model's last hidden state)
    next token = argmax(hidden @ unembed)            greedy; a request with 2 samples adds
                                                     seeded Gumbel noise (sampling at T=1)

Serving: each layer is a module built with seq_len=None and kv_block_size=16; its keys and
values live in a mhagen.PagedKVCache of --blocks blocks (one pool per layer, the same block
tables in each). A step packs the new tokens of up to --max-seqs sequences, at most
--token-budget in all (x [1, total, d_model] with cu_seqlens), and calls each layer once:
sequences adding one token (decoding) beside chunks of prompts (prefill).

Scheduling policy (vLLM's block manager and chunked-prefill scheduler, simplified):
  * A sequence's pending tokens are its known tokens not yet in the cache: a new request's
    prompt, or the token sampled last step. A step takes, in this order, while it has rows
    (--max-seqs) and tokens (--token-budget) left:
    1. running sequences with one pending token (decodes), earliest arrival first;
    2. running sequences still in their prompt: a chunk of at most the tokens left (chunked
       prefill: a longer prompt goes on next step), oldest first;
    3. waiting requests that have arrived, first come first served (none overtakes the
       head of the queue). The head is admitted when, after this step's decodes have their
       blocks, the pool still holds its whole prompt with a watermark of 1% of the blocks
       to spare (vLLM's can_allocate); else it waits (the pool is full). The prompt's
       blocks are taken at admission (pool.reserve), so a prefill in progress never runs
       out of blocks.
  * Decodes take blocks as they grow (a new block every 16 tokens, a copy of a shared
    block they write into). When the pool cannot give a step's decodes their blocks, the
    running request that arrived last is preempted: its blocks are freed and it goes back
    to the head of the queue, to be recomputed from its prompt and the tokens it had
    generated (vLLM's recompute preemption); repeated until the step fits.
  * A sample that has its tokens frees its sequence at once: the blocks go back to the
    pool for the requests waiting.
  * A request with 2 samples (--forked; parallel sampling) feeds its prompt once; then
    pool.fork gives the second sample a sequence sharing the prompt's blocks, and the first
    token either writes into the shared last block copies that block (copy-on-write).

Checked (exit 1 on a mismatch): every request's output tokens (each sample's) equal those of
running the request alone through the same model (a contiguous mhagen.KVCache of one
sequence, the prompt in one call, then one token a call) exactly, and the last hidden
states of every position within the float32 tolerance; the alone run of the first request
against the float64 reference of the whole sequence; every block back in the pool at the
end. Prints tokens/s of both runs (the same requests one at a time: the ratio) and the
pool's occupancy.

Run: python examples/serve.py [--quick] [--requests 32] [--blocks 256] ... (--help lists all)
"""

import argparse
import os
import sys
import time
from collections import deque
from dataclasses import dataclass

# numpy's BLAS runs the glue (norms, the unembedding) on one thread: with a thread of its
# own on each core it takes turns with the kernels' threads, and a small product waits on
# a busy core (set before numpy starts its threads)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import mhagen  # noqa: E402
from mhagen.tolerances import max_error, tolerance  # noqa: E402

BLOCK_SIZE = 16
DEFAULTS = dict(d_model=1024, heads=16, kv_heads=4, layers=2, vocab=1024, requests=32,
                min_prompt=16, max_prompt=256, min_new=16, max_new=128, max_seqs=32,
                token_budget=512, blocks=256, arrival_rate=2.0, forked=1)
# small enough for a test: every path runs (chunks, waits for blocks, preemption, a fork)
QUICK = dict(d_model=64, heads=4, kv_heads=2, layers=2, vocab=64, requests=10,
             min_prompt=1, max_prompt=40, min_new=1, max_new=24, max_seqs=4,
             token_budget=24, blocks=10, arrival_rate=1.0, forked=2)


# -- the model -----------------------------------------------------------------------------
class Model:
    """The decoder's numpy parts and its attention layers' weights (see the docstring)."""

    def __init__(self, d_model, heads, kv_heads, layers, vocab, max_len, seed=0):
        style = dict(kv_heads=kv_heads, causal=True, rotary=True)
        self.layer = mhagen.mha(d_model, heads, kv_cache=max_len, **style)
        self.whole = mhagen.mha(d_model, heads, **style)     # the float64 check's layer
        self.weights = [self.layer.init_weights(seed + 1 + i) for i in range(layers)]
        rng = np.random.default_rng(seed)
        self.embed = rng.standard_normal((vocab, d_model)).astype(np.float32)
        self.gains = [(1 + 0.1 * rng.standard_normal(d_model)).astype(np.float32)
                      for _ in range(layers + 1)]
        self.unembed = (rng.standard_normal((d_model, vocab)) / np.sqrt(d_model)).astype(
            np.float32)
        self.vocab, self.max_len = vocab, max_len

    def norm(self, h, i):
        """RMSNorm of the rows of h with gain i (the last gain: the output's)."""
        scale = 1 / np.sqrt(np.mean(np.square(h), axis=-1, keepdims=True) + 1e-6)
        return (h * scale * self.gains[i]).astype(h.dtype)

    def forward(self, tokens, attend):
        """The last hidden states [n, d] of `tokens`; attend(i, x [1, n, d]) runs layer i."""
        h = self.embed[tokens][None]
        for i in range(len(self.weights)):
            h = h + attend(i, self.norm(h, i))
        return self.norm(h, -1)[0]

    def reference(self, tokens):
        """float64: the whole sequence at once through each layer's reference."""
        h = self.embed[tokens][None].astype(np.float64)
        for i, w in enumerate(self.weights):
            h = h + self.whole.reference(self.norm(h, i), w)
        return self.norm(h, -1)[0]


def scores(logits, req, sample, position, seed):
    """What the token at `position` of `sample` of request `req` maximizes: its logits
    (greedy), or for a request with several samples logits + Gumbel noise (argmax of that
    is a draw from softmax(logits): sampling at temperature 1), the noise seeded by (seed,
    request, sample, position), the same in both runs."""
    if req.samples == 1:
        return logits
    rng = np.random.default_rng([seed, req.rid, sample, position])
    return logits + rng.gumbel(size=logits.shape).astype(np.float32)


def top2_gap(score) -> float:
    """How far the chosen token's score is from the next one's (a near tie can flip on
    rounding: the check reports it where tokens differ)."""
    two = np.partition(score, -2)[-2:]
    return float(two[1] - two[0])


# -- requests ------------------------------------------------------------------------------
@dataclass
class Request:
    rid: int
    arrival: int                   # the step it arrives at
    prompt: list
    max_new: int                   # tokens each sample generates
    samples: int = 1
    outputs: list = None           # each sample's generated tokens
    hidden: list = None            # each sample's last hidden states, by position
    forked: bool = False           # its prompt's sequence was forked since its admission
    admitted: int | None = None    # the step of its first admission
    finished: int | None = None
    preempted: int = 0
    chunked: bool = False          # a step took only part of its prompt

    def __post_init__(self):
        self.outputs = [[] for _ in range(self.samples)]

    def live(self) -> list:
        """Samples still generating."""
        return [s for s in range(self.samples) if len(self.outputs[s]) < self.max_new]

    def prefix(self) -> int:
        """Tokens a new sequence of this request holds before it forks: the prompt while
        several samples share it, else all the known tokens of its one sample."""
        live = self.live()
        return len(self.prompt) + (0 if len(live) > 1 else len(self.outputs[live[0]]))


def make_requests(n, vocab, min_prompt, max_prompt, min_new, max_new, arrival_rate, forked,
                  seed) -> list:
    """n requests, random prompt tokens and lengths, arriving as a Poisson process of
    arrival_rate requests a step; `forked` of them (chosen at random) take 2 samples."""
    rng = np.random.default_rng(seed)
    arrivals = np.floor(np.cumsum(rng.exponential(1 / arrival_rate, n))).astype(int)
    two = set(rng.choice(n, size=min(forked, n), replace=False).tolist())
    return [Request(i, int(arrivals[i] - arrivals[0]),
                    rng.integers(0, vocab, int(rng.integers(min_prompt, max_prompt + 1))).tolist(),
                    int(rng.integers(min_new, max_new + 1)), 2 if i in two else 1)
            for i in range(n)]


# -- serving: one step at a time, one call per layer ------------------------------------
@dataclass
class Seq:
    """A sequence of the pools: one sample of a request (before its fork: all of them)."""
    sid: int
    req: Request
    sample: int
    fed: int = 0                   # tokens in the cache

    def pending(self) -> int:
        req = self.req
        known = len(req.prompt) + (0 if self.shared() else len(req.outputs[self.sample]))
        return known - self.fed

    def next_tokens(self, n) -> list:
        """Its n tokens from the first one not in the cache on (the prompt's, then its
        sample's outputs)."""
        prompt, out = self.req.prompt, self.req.outputs[self.sample]
        a, b = self.fed, self.fed + n
        return prompt[a:b] + out[max(0, a - len(prompt)):max(0, b - len(prompt))]

    def shared(self) -> bool:
        """Still the prompt of several samples (not forked yet)."""
        return not self.req.forked and len(self.req.live()) > 1


class Pools:
    """The layers' PagedKVCaches, told the same operations (the same ids and block tables
    in each); questions go to the first."""

    def __init__(self, modules, num_blocks):
        self.all = [m.new_paged_cache(num_blocks) for m in modules]
        self.first = self.all[0]

    def _each(self, op, *args):
        got = {getattr(p, op)(*args) for p in self.all}
        assert len(got) == 1, f"the pools disagree on {op}: {got}"
        return got.pop()

    def add(self):
        return self._each("add")

    def fork(self, sid):
        return self._each("fork", sid)

    def free(self, sid):
        self._each("free", sid)

    def reserve(self, sid, n):
        for p in self.all:
            p.reserve([sid], [n])

    def blocks_needed(self, sid, n) -> int:
        """Blocks a call adding n tokens to sid takes from the pool: new ones past its table
        and copies of shared blocks it writes into (what the call's reserve does)."""
        pool, bs = self.first, self.first.block_size
        held, table = pool.lens(sid), pool.blocks(sid)
        new = max(0, -(-(held + n) // bs) - len(table))
        written = table[held // bs:(held + n - 1) // bs + 1]
        return new + sum(pool.refcount(b) > 1 for b in written)


class Server:
    """The scheduler (see the docstring's policy) over the paged modules of the model."""

    def __init__(self, model, modules, num_blocks, max_seqs, token_budget, seed):
        self.model, self.modules, self.seed = model, modules, seed
        self.pools = Pools(modules, num_blocks)
        self.max_seqs, self.token_budget = max_seqs, token_budget
        self.watermark = -(-num_blocks // 100)
        self.running: list[Seq] = []       # arrival order (a fork right after its parent)
        self.waiting: deque = deque()
        self.log = []                      # one dict a step

    def serve(self, requests) -> None:
        incoming = deque(sorted(requests, key=lambda r: (r.arrival, r.rid)))
        for r in requests:
            r.hidden = [np.zeros((len(r.prompt) + r.max_new - 1, self.model.embed.shape[1]),
                                 np.float32) for _ in range(r.samples)]
        step = 0
        while incoming or self.waiting or self.running:
            while incoming and incoming[0].arrival <= step:
                self.waiting.append(incoming.popleft())
            self.step(step)
            step += 1

    def step(self, step) -> None:
        plan, blocked = self.schedule(step)
        if plan:
            self.run(plan)
        used = self.pools.first.used_blocks
        self.log.append(dict(step=step, decodes=sum(n == 1 for _, n in plan),
                             prefills=sum(n > 1 for _, n in plan),
                             tokens=sum(n for _, n in plan), used=used,
                             waiting=len(self.waiting), blocked=blocked))

    def schedule(self, step):
        """[(sequence, new tokens)] of this step, and whether the queue's head waited for
        blocks."""
        while True:
            plan, rows, budget = [], self.max_seqs, self.token_budget
            for seq in [s for s in self.running if s.pending() == 1] + \
                       [s for s in self.running if s.pending() > 1]:
                if rows and budget:
                    n = min(seq.pending(), budget)
                    plan.append((seq, n))
                    rows, budget = rows - 1, budget - n
            need = sum(self.pools.blocks_needed(s.sid, n) for s, n in plan)
            if need <= self.pools.first.free_blocks:
                break
            self.preempt(self.running[-1].req)      # the latest arrival: recomputed later
        blocked = False
        while self.waiting and rows and budget:
            req = self.waiting[0]
            prefix = req.prefix()
            if self.pools.first.free_blocks - need - -(-prefix // BLOCK_SIZE) < self.watermark:
                blocked = True                       # the pool is full: it waits
                break
            self.waiting.popleft()
            req.admitted = step if req.admitted is None else req.admitted
            req.forked = False
            seq = Seq(self.pools.add(), req, req.live()[0])
            self.pools.reserve(seq.sid, prefix)      # its prompt's blocks, held from now
            self.running.append(seq)
            self.running.sort(key=lambda s: (s.req.arrival, s.req.rid))   # stable: forks
            n = min(prefix, budget)
            plan.append((seq, n))
            rows, budget = rows - 1, budget - n
        return plan, blocked

    def preempt(self, req) -> None:
        for seq in [s for s in self.running if s.req is req]:
            self.pools.free(seq.sid)
            self.running.remove(seq)
        req.preempted += 1
        self.waiting.appendleft(req)

    def run(self, plan) -> None:
        """One call per layer over the plan's tokens; then forks, samples, frees."""
        counts = [n for _, n in plan]
        cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        tokens = [t for seq, n in plan for t in seq.next_tokens(n)]
        sids = [seq.sid for seq, _ in plan]
        hidden = self.model.forward(tokens, lambda i, x: self.modules[i](
            x, cache=self.pools.all[i], seqs=sids, cu_seqlens=cu))
        caught_up = []                     # (a sequence that fed all its tokens, its last row)
        for (seq, n), start in zip(plan, cu[:-1]):
            req = seq.req
            req.chunked |= n < seq.pending()
            for s in (req.live() if seq.shared() else [seq.sample]):
                req.hidden[s][seq.fed:seq.fed + n] = hidden[start:start + n]
            seq.fed += n
            family = [seq]
            if seq.shared() and seq.fed == len(req.prompt):    # parallel sampling: fork
                req.forked = True
                at = self.running.index(seq)
                for s in req.live()[1:]:
                    family.append(Seq(self.pools.fork(seq.sid), req, s, seq.fed))
                    self.running.insert(at + len(family) - 1, family[-1])
            caught_up += [(member, start + n - 1) for member in family if member.pending() == 0]
        if not caught_up:
            return
        logits = hidden[[row for _, row in caught_up]] @ self.model.unembed
        for (seq, _), row_logits in zip(caught_up, logits):
            req, out = seq.req, seq.req.outputs[seq.sample]
            out.append(int(np.argmax(scores(row_logits, req, seq.sample, len(out), self.seed))))
            if len(out) == req.max_new:
                self.pools.free(seq.sid)                       # done: its blocks go back
                self.running.remove(seq)
                if not req.live():
                    req.finished = len(self.log)


# -- one request at a time: the check and the baseline -------------------------------------
class Alone:
    """The model on one sequence: contiguous caches (one row), the prompt in one call, then
    one token a call through prepared calls (the step's arrays bound once)."""

    def __init__(self, model, modules, seed):
        self.model, self.modules, self.seed = model, modules, seed
        self.caches = [m.new_cache() for m in modules]
        d = model.embed.shape[1]
        self.inputs = [mhagen.aligned_empty((1, 1, d)) for _ in modules]
        self.steps = [m.prepare(x, cache=c) for m, x, c in
                      zip(modules, self.inputs, self.caches)]

    def decode_layer(self, i, x):
        self.inputs[i][...] = x
        return self.steps[i]()

    def generate(self, req, sample):
        """(tokens, last hidden states by position, top-2 gaps) of one sample of req."""
        for c in self.caches:
            c.reset()
        hidden = [self.model.forward(req.prompt, lambda i, x: self.modules[i](
            x, cache=self.caches[i]))]
        out, gaps = [], []
        while True:
            score = scores(hidden[-1][-1] @ self.model.unembed, req, sample, len(out), self.seed)
            gaps.append(top2_gap(score))
            out.append(int(np.argmax(score)))
            if len(out) == req.max_new:
                return out, np.concatenate(hidden), gaps
            hidden.append(self.model.forward(out[-1:], self.decode_layer))


# -- the run -------------------------------------------------------------------------------
def build(model, target, max_seqs, token_budget, max_prompt):
    """(paged modules, one-sequence modules) of each layer."""
    per_row = -(-token_budget // max_seqs)     # the build holds max_seqs x per_row tokens
    paged = [mhagen.build(model.layer, target, batch=max_seqs, seq_len=None,
                          max_seq_len=per_row, weights=w, kv_block_size=BLOCK_SIZE)
             for w in model.weights]
    alone = [mhagen.build(model.layer, target, batch=1, seq_len=None, max_seq_len=max_prompt,
                          weights=w) for w in model.weights]
    return paged, alone


def warm_up(paged, alone, d_model) -> None:
    """A call of each module before the clocks start (a first call pays one-time costs)."""
    x = np.zeros((1, 1, d_model), np.float32)
    for m in paged:
        pool = m.new_paged_cache(1)
        m(x, cache=pool, seqs=[pool.add()], cu_seqlens=[0, 1])
    for m in alone:
        m(x, cache=m.new_cache())
        m.prepare(mhagen.aligned_empty(x.shape), cache=m.new_cache())()


def make_model(cfg, seed=0) -> Model:
    return Model(cfg["d_model"], cfg["heads"], cfg["kv_heads"], cfg["layers"], cfg["vocab"],
                 cfg["max_prompt"] + cfg["max_new"], seed)


def compare(requests, expected):
    """(mismatches, requests whose tokens differ, worst hidden-state error / tolerance,
    smallest top-2 gap of the alone runs) of the served requests against expected, each
    sample's (tokens, hidden states, top-2 gaps) run alone."""
    mismatches, token_mismatches, worst_ratio, min_gap = [], 0, 0.0, np.inf
    for r in requests:
        for s in range(r.samples):
            tokens, hidden, gaps = expected[(r.rid, s)]
            min_gap = min(min_gap, min(gaps))
            if r.outputs[s] != tokens:
                at = next(i for i, (a, b) in enumerate(zip(r.outputs[s], tokens)) if a != b)
                mismatches.append(f"request {r.rid} sample {s}: tokens differ from token {at} "
                                  f"on (alone: top-2 gap {gaps[at]:.3g})")
                token_mismatches += 1
                continue
            err, tol = max_error(r.hidden[s], hidden), tolerance(hidden)
            worst_ratio = max(worst_ratio, err / tol)
            if not err <= tol:
                mismatches.append(f"request {r.rid} sample {s}: last hidden states off by "
                                  f"{err:.3g} (tolerance {tol:.3g})")
    return mismatches, token_mismatches, worst_ratio, min_gap


def pool_problems(pools) -> list:
    """What is wrong with the pools after every request finished: blocks still held, block
    counts that are not the sequences holding them."""
    problems = []
    for i, pool in enumerate(pools.all):
        if pool.used_blocks:
            problems.append(f"layer {i}: {pool.used_blocks} blocks still held after every "
                            "request finished")
        try:
            pool.check()
        except AssertionError as e:
            problems.append(f"layer {i}: the pool's block counts are inconsistent: {e}")
    return problems


def check_config(cfg) -> None:
    """InputError unless cfg's numbers make a run (the others: mhagen.mha and build say)."""
    for name, value in cfg.items():
        least = 2 if name == "vocab" else 0 if name == "forked" else 1
        if not value >= least:
            raise mhagen.InputError(f"--{name.replace('_', '-')} must be at least {least}, "
                                    f"got {value}")
    for low, high in (("min_prompt", "max_prompt"), ("min_new", "max_new")):
        if cfg[low] > cfg[high]:
            raise mhagen.InputError(f"--{low.replace('_', '-')} {cfg[low]} is more than "
                                    f"--{high.replace('_', '-')} {cfg[high]}")


def run(cfg, target="x86", seed=0, modules=None, repeat=1) -> dict:
    """Serve cfg's requests, run them one at a time, check; modules: build()'s result for
    make_model(cfg, seed) where the caller has it (built here otherwise); repeat: times
    both runs go (alternated; the medians reported), each checked."""
    check_config(cfg)
    model = make_model(cfg, seed)

    def new_requests():
        return make_requests(cfg["requests"], cfg["vocab"], cfg["min_prompt"],
                             cfg["max_prompt"], cfg["min_new"], cfg["max_new"],
                             cfg["arrival_rate"], cfg["forked"], seed)
    requests = new_requests()
    worst = max(-(-(len(r.prompt) + r.max_new) // BLOCK_SIZE) * r.samples for r in requests)
    if worst > cfg["blocks"] - -(-cfg["blocks"] // 100):
        raise mhagen.InputError(f"a request needs up to {worst} blocks of {BLOCK_SIZE} alone; "
                                f"--blocks {cfg['blocks']} (less the 1% watermark) cannot "
                                "hold it: give more blocks")
    paged, alone_modules = modules or build(model, target, cfg["max_seqs"],
                                            cfg["token_budget"], cfg["max_prompt"])
    warm_up(paged, alone_modules, cfg["d_model"])
    alone = Alone(model, alone_modules, seed)
    served_s, alone_s, checks = [], [], []
    for _ in range(repeat):        # alternated: on a busy machine the timings swing
        requests = new_requests()
        server = Server(model, paged, cfg["blocks"], cfg["max_seqs"], cfg["token_budget"],
                        seed)
        t0 = time.perf_counter()
        server.serve(requests)
        served_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        expected = {(r.rid, s): alone.generate(r, s) for r in requests
                    for s in range(r.samples)}
        alone_s.append(time.perf_counter() - t0)
        checks.append(compare(requests, expected))
        checks[-1][0].extend(pool_problems(server.pools))
    mismatches = sorted({line for c in checks for line in c[0]})
    token_mismatches = max(c[1] for c in checks)
    worst_ratio, min_gap = max(c[2] for c in checks), min(c[3] for c in checks)
    first = requests[0]
    fed = first.prompt + expected[(first.rid, 0)][0][:-1]
    reference = model.reference(fed)
    ref_err, ref_tol = max_error(expected[(first.rid, 0)][1], reference), tolerance(reference)
    if not ref_err <= ref_tol:
        mismatches.append(f"request {first.rid} alone: off the float64 reference by "
                          f"{ref_err:.3g} (tolerance {ref_tol:.3g})")
    return dict(requests=requests, log=server.log, served_s=float(np.median(served_s)),
                alone_s=float(np.median(alone_s)), repeat=repeat,
                mismatches=mismatches, token_mismatches=token_mismatches,
                worst_ratio=worst_ratio, min_gap=min_gap, ref_err=ref_err, ref_tol=ref_tol,
                num_blocks=cfg["blocks"], modules=paged, cfg=cfg)


def report(r) -> None:
    reqs, log, cfg = r["requests"], r["log"], r["cfg"]
    generated = sum(q.max_new * q.samples for q in reqs)
    prompts = sum(len(q.prompt) for q in reqs)
    fed = sum(s["tokens"] for s in log)
    used = np.array([s["used"] for s in log])
    nb = r["num_blocks"]
    print(f"{r['modules'][0]}\n{cfg['layers']} layers, vocab {cfg['vocab']}, {len(reqs)} "
          f"requests ({sum(q.samples == 2 for q in reqs)} with 2 samples): prompts "
          f"{cfg['min_prompt']}..{cfg['max_prompt']} ({prompts} tokens), outputs "
          f"{cfg['min_new']}..{cfg['max_new']} ({generated} tokens)")
    print(f"pool: {nb} blocks of {BLOCK_SIZE} a layer; a step: at most {cfg['max_seqs']} "
          f"sequences, {cfg['token_budget']} tokens")
    print("\n step  decodes  prefills  tokens  blocks used  waiting")
    shown = sorted(set(np.linspace(0, len(log) - 1, min(12, len(log))).astype(int).tolist())
                   | {int(np.argmax(used))})
    for i in shown:
        s = log[i]
        print(f"{s['step']:5d}  {s['decodes']:7d}  {s['prefills']:8d}  {s['tokens']:6d}  "
              f"{s['used']:5d} ({100 * s['used'] / nb:3.0f}%)  {s['waiting']:7d}"
              + ("  (head waits for blocks)" if s["blocked"] else ""))
    # without preemption each prompt is fed once, each sample's tokens but its last
    first_time = prompts + sum(q.samples * (q.max_new - 1) for q in reqs)
    print(f"\n{len(log)} steps, {fed} tokens fed ({fed - first_time} recomputed after "
          f"preemption); pool occupancy: peak {used.max()} of {nb} blocks "
          f"({100 * used.max() / nb:.0f}%), mean {100 * used.mean() / nb:.0f}%, median "
          f"{100 * np.median(used) / nb:.0f}%")
    print(f"steps where the queue's head waited for blocks: {sum(s['blocked'] for s in log)}; "
          f"preemptions: {sum(q.preempted for q in reqs)}; prompts split over steps "
          f"(chunked prefill): {sum(q.chunked for q in reqs)}; forked requests: "
          f"{sum(q.samples == 2 for q in reqs)}")
    waits = [q.admitted - q.arrival for q in reqs]
    print(f"steps from arrival to admission: mean {np.mean(waits):.1f}, max {max(waits)}")
    served, alone = generated / r["served_s"], generated / r["alone_s"]
    if r["repeat"] > 1:
        print(f"\ntimes: the medians of {r['repeat']} runs of each, alternated")
    print(f"\ncontinuous batching: {r['served_s']:.2f} s, {served:.1f} generated tokens/s "
          f"({(prompts + generated) / r['served_s']:.1f} prompt + generated tokens/s)")
    print(f"one request at a time: {r['alone_s']:.2f} s, {alone:.1f} generated tokens/s "
          f"({(prompts + generated) / r['alone_s']:.1f} prompt + generated tokens/s)")
    print(f"ratio: {served / alone:.2f}x the tokens/s of one at a time")
    print(f"\nfirst request alone vs the float64 reference: max error {r['ref_err']:.3g} "
          f"(tolerance {r['ref_tol']:.3g})")
    samples = sum(q.samples for q in reqs)
    print(f"outputs equal to their request run alone: {samples - r['token_mismatches']} of "
          f"{samples} (every token); last hidden states at most {r['worst_ratio']:.2g} x the "
          f"float32 tolerance; smallest top-2 score gap of the alone runs {r['min_gap']:.3g}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small model and few requests "
                   f"(the test's run): {QUICK}")
    p.add_argument("--target", default="x86")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1, help="run both N times, alternated, "
                   "and report the median times (a busy machine's timings swing)")
    for name, value in DEFAULTS.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=None,
                       help=f"default {value} (--quick: {QUICK[name]})")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat takes a count of 1 or more")
    cfg = {k: getattr(args, k) if getattr(args, k) is not None else
           (QUICK if args.quick else DEFAULTS)[k] for k in DEFAULTS}
    try:
        r = run(cfg, args.target, args.seed, repeat=args.repeat)
    except mhagen.MhagenError as e:
        p.error(str(e))          # one line, exit status 2
    report(r)
    for line in r["mismatches"]:
        print("MISMATCH:", line)
    return 1 if r["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
