"""Per-request logits rules as batched processors with state that persists across iterations.

Each processor keeps what it needs of the requests that have its rule, from when a request
joins (`add`) to when it leaves (`remove`), and changes the logits of an iteration's rows in
one vectorized operation over the (row, token) pairs its rules touch: never a pass over the
whole vocabulary per row, never a tensor per row per iteration. The order is vLLM's: allowed
tokens, logit bias, penalties, bans (min_tokens' stops, bad words).

Penalties keep each request's distinct tokens (prompt and output) and how often each has been
output, in padded tensors updated from the tokens it gained since the last iteration.
"""
from __future__ import annotations

import torch

from .state import RunnerRequest


class _Pairs:
    """A batch's rows joined with fixed per-request tensors (token ids, and values for them):
    the row of each entry and the entries, made in one concatenation and kept while the batch's
    rows stay the same. `key` names them: (row, request, which list) for each, the requests by
    identity (the key holds them, so none is freed and its id reused meanwhile)."""

    def __init__(self) -> None:
        self._key: tuple = ()
        self._pairs: tuple[torch.Tensor, ...] = ()

    def of(self, rows: list[int], fields: list[list[torch.Tensor]], key: tuple) -> tuple[torch.Tensor, ...]:
        if key != self._key or not self._pairs:
            device = fields[0][0].device
            lengths = torch.tensor([len(t) for t in fields[0]], device=device)
            self._pairs = (torch.tensor(rows, device=device).repeat_interleave(lengths),
                           *(torch.cat(tensors) for tensors in fields))
            self._key = key
        return self._pairs


class AllowedTokens:
    """vLLM's allowed_token_ids: every other token of the row is -inf."""

    def __init__(self, device: torch.device) -> None:
        self._ids: dict[RunnerRequest, torch.Tensor] = {}
        self._pairs = _Pairs()
        self.device = device

    def add(self, state: RunnerRequest) -> None:
        if state.params.allowed_token_ids is not None:
            self._ids[state] = torch.tensor(sorted(set(state.params.allowed_token_ids)), device=self.device)

    def remove(self, state: RunnerRequest) -> None:
        self._ids.pop(state, None)

    def apply(self, logits: torch.Tensor, states: list[RunnerRequest]) -> None:
        mine = [(i, s) for i, s in enumerate(states) if s in self._ids]
        if not mine:
            return
        rows, ids = self._pairs.of([i for i, _ in mine], [[self._ids[s] for _, s in mine]], tuple(mine))
        kept = logits[rows, ids]
        logits[torch.tensor([i for i, _ in mine], device=logits.device)] = float("-inf")
        logits[rows, ids] = kept


class LogitBias:
    """OpenAI's logit_bias: a value added to chosen tokens' logits."""

    def __init__(self, device: torch.device) -> None:
        self._bias: dict[RunnerRequest, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pairs = _Pairs()
        self.device = device

    def add(self, state: RunnerRequest) -> None:
        bias = state.params.logit_bias
        if bias:
            self._bias[state] = (torch.tensor(list(bias), device=self.device),
                                 torch.tensor(list(bias.values()), dtype=torch.float32, device=self.device))

    def remove(self, state: RunnerRequest) -> None:
        self._bias.pop(state, None)

    def apply(self, logits: torch.Tensor, states: list[RunnerRequest]) -> None:
        mine = [(i, s) for i, s in enumerate(states) if s in self._bias]
        if not mine:
            return
        rows, ids, values = self._pairs.of([i for i, _ in mine], [[self._bias[s][0] for _, s in mine],
                                                                  [self._bias[s][1] for _, s in mine]], tuple(mine))
        logits.index_put_((rows, ids), values.to(logits.dtype), accumulate=True)


class Penalties:
    """vLLM's repetition penalty (over prompt and output tokens) and OpenAI's frequency and
    presence penalties (over output tokens), for the requests that set one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._reset()

    def _reset(self) -> None:
        device = self.device
        self._slot: dict[RunnerRequest, int] = {}
        self._free: list[int] = []
        self._seen: list[dict[int, int]] = []  # per slot: token -> its column
        self._num_counted: list[int] = []  # per slot: tokens of its history counted so far
        self.ids = torch.zeros(0, 1, dtype=torch.long, device=device)  # [slots, columns] distinct tokens
        self.counts = torch.zeros(0, 1, device=device)  # [slots, columns] times output
        self.num_ids = torch.zeros(0, dtype=torch.long, device=device)  # [slots] columns in use

    def add(self, state: RunnerRequest) -> None:
        if not state.params.needs_penalties:
            return
        slot = self._free.pop() if self._free else self._new_slot()
        self._slot[state] = slot
        self._seen[slot], self._num_counted[slot] = {}, 0
        self.num_ids[slot] = 0

    def remove(self, state: RunnerRequest) -> None:
        slot = self._slot.pop(state, None)
        if slot is not None:
            self._free.append(slot)
            self._seen[slot] = {}
        if not self._slot and self._seen:  # nobody left: give the memory back
            self._reset()

    def apply(self, logits: torch.Tensor, states: list[RunnerRequest]) -> None:
        mine = [(i, s, self._slot[s]) for i, s in enumerate(states) if s in self._slot]
        if not mine:
            return
        self._count_new_tokens(mine)
        device = logits.device
        rows = torch.tensor([i for i, _, _ in mine], device=device)
        slots = torch.tensor([slot for _, _, slot in mine], device=device)
        # [rows, columns] padded: a pad repeats the row's first token, with its count, so that
        # the scatter writes that token's one new value more than once (nothing else)
        width = max(len(self._seen[slot]) for _, _, slot in mine)  # the batch's own, not the widest ever
        used = torch.arange(width, device=device)[None, :] < self.num_ids[slots][:, None]
        ids, counts = self.ids[slots, :width], self.counts[slots, :width]
        ids, counts = torch.where(used, ids, ids[:, :1]), torch.where(used, counts, counts[:, :1])
        params = torch.tensor([[s.params.repetition_penalty, s.params.frequency_penalty, s.params.presence_penalty]
                               for _, s, _ in mine], device=device)
        at = rows[:, None] * logits.shape[1] + ids  # [rows, columns] into the flat logits
        flat = logits.view(-1)
        values = flat[at].float()
        repetition = params[:, :1]
        values = torch.where(values > 0, values / repetition, values * repetition)
        values -= params[:, 1:2] * counts + params[:, 2:3] * (counts > 0).float()
        flat[at] = values.to(logits.dtype)

    def _new_slot(self) -> int:
        slot = len(self._seen)
        self._seen.append({})
        self._num_counted.append(0)
        self.ids = _grow_rows(self.ids, slot + 1)
        self.counts = _grow_rows(self.counts, slot + 1)
        self.num_ids = torch.cat([self.num_ids, self.num_ids.new_zeros(1)])
        return slot

    def _count_new_tokens(self, mine: list) -> None:
        """Bring each row's distinct tokens and output counts up to its history (usually one
        token more than last time), in one scatter for the batch."""
        new_slots, new_columns, new_ids, counted_slots, counted_columns = [], [], [], [], []
        for _, state, slot in mine:
            seen, start = self._seen[slot], self._num_counted[slot]
            tokens = state.token_ids
            for position in range(start, len(tokens)):
                token = tokens[position]
                column = seen.get(token)
                if column is None:
                    column = seen[token] = len(seen)
                    new_slots.append(slot)
                    new_columns.append(column)
                    new_ids.append(token)
                if position >= state.num_prompt_tokens:
                    counted_slots.append(slot)
                    counted_columns.append(column)
            self._num_counted[slot] = len(tokens)
        if new_ids:
            width = max(len(self._seen[slot]) for _, _, slot in mine)
            if width > self.ids.shape[1]:
                self.ids = _grow_columns(self.ids, width)
                self.counts = _grow_columns(self.counts, width)
            at = (torch.tensor(new_slots, device=self.device), torch.tensor(new_columns, device=self.device))
            self.ids.index_put_(at, torch.tensor(new_ids, device=self.device))
            self.counts.index_put_(at, self.counts.new_zeros(len(new_ids)))
            touched = torch.tensor(sorted({slot for _, _, slot in mine}), device=self.device)
            self.num_ids[touched] = torch.tensor([len(self._seen[int(s)]) for s in touched.tolist()],
                                                 device=self.device)
        if counted_slots:
            at = (torch.tensor(counted_slots, device=self.device), torch.tensor(counted_columns, device=self.device))
            self.counts.index_put_(at, self.counts.new_ones(len(counted_slots)), accumulate=True)


class TokenBans:
    """Tokens a row may not take: min_tokens' stops (stop_token_ids and, unless ignore_eos,
    end of sequence) until it has min_tokens outputs, each one-token bad word always, and a
    longer bad word's last token where the output ends with the rest of it."""

    def __init__(self, device: torch.device, eos_token_ids: list[int], vocab_size: int | None = None) -> None:
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self._until_min: dict[RunnerRequest, torch.Tensor] = {}
        self._always: dict[RunnerRequest, torch.Tensor] = {}
        self._words: dict[RunnerRequest, list[list[int]]] = {}  # bad words of two tokens or more
        self._pairs = _Pairs()

    def add(self, state: RunnerRequest) -> None:
        p = state.params
        stops = p.stop_token_ids + ([] if p.ignore_eos else self.eos_token_ids)
        if p.min_tokens and stops:
            self._until_min[state] = torch.tensor(stops, device=self.device)
        words = [w for w in p.bad_words_token_ids if self.vocab_size is None or max(w) < self.vocab_size]
        single = [word[0] for word in words if len(word) == 1]
        if single:
            self._always[state] = torch.tensor(single, device=self.device)
        longer = [word for word in words if len(word) > 1]
        if longer:
            self._words[state] = longer

    def remove(self, state: RunnerRequest) -> None:
        for rules in (self._until_min, self._always, self._words):
            rules.pop(state, None)

    def apply(self, logits: torch.Tensor, states: list[RunnerRequest]) -> None:
        rows, lists, key = [], [], []
        for i, s in enumerate(states):
            for rules, on in ((self._until_min, s.num_output_tokens < s.params.min_tokens), (self._always, True)):
                if on and s in rules:
                    rows.append(i)
                    lists.append(rules[s])
                    key.append((i, s, rules is self._always))
        if rows:
            logits[self._pairs.of(rows, [lists], tuple(key))] = float("-inf")
        words = [(i, word[-1]) for i, s in enumerate(states) for word in self._words.get(s, ())
                 if _ends_with(s, word[:-1])]
        if words:
            logits[torch.tensor(words, device=logits.device).T.unbind()] = float("-inf")


class LogitsProcessors:
    """The chain, in order; `add` and `remove` as requests join and leave the runner that samples."""

    def __init__(self, device: torch.device, eos_token_ids: list[int], vocab_size: int | None = None) -> None:
        """`vocab_size`: the logits' width (None: not checked). A rule's token beyond it is
        refused when its request joins; a bad word with one is dropped (it cannot be written)."""
        self.chain = (AllowedTokens(device), LogitBias(device), Penalties(device),
                      TokenBans(device, eos_token_ids, vocab_size))
        self.vocab_size = vocab_size

    def add(self, state: RunnerRequest) -> None:
        """A request joins; one whose rules cannot be applied fails alone (`state.failure`)."""
        try:
            self._check(state)
            for processor in self.chain:
                processor.add(state)
        except Exception as e:
            self.remove(state)
            state.failure = state.failure or f"its logits rules cannot be applied: {e}"

    def _check(self, state: RunnerRequest) -> None:
        p = state.params
        for name, ids in (("allowed_token_ids", p.allowed_token_ids or ()), ("logit_bias", p.logit_bias or ())):
            if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"{name} holds a token id outside the model's {self.vocab_size} tokens")

    def remove(self, state: RunnerRequest) -> None:
        for processor in self.chain:
            processor.remove(state)

    def apply(self, logits: torch.Tensor, states: list[RunnerRequest]) -> None:
        """logits [len(states), vocab] in place, row i being states[i]'s."""
        for processor in self.chain:
            processor.apply(logits, states)

    def touches(self, state: RunnerRequest) -> bool:
        """Whether some processor changes this request's logits."""
        p = state.params
        return p.needs_penalties or p.needs_logit_rules or bool(p.min_tokens)


def _ends_with(state: RunnerRequest, prefix: list[int]) -> bool:
    tokens = state.token_ids
    return state.num_output_tokens >= len(prefix) and tokens[len(tokens) - len(prefix):] == prefix


def _grow_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """At least `rows` rows, doubling (the new ones zero)."""
    if rows <= t.shape[0]:
        return t
    return torch.cat([t, t.new_zeros(max(rows, 2 * t.shape[0]) - t.shape[0], t.shape[1])])


def _grow_columns(t: torch.Tensor, columns: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(t.shape[0], max(columns, 2 * t.shape[1]) - t.shape[1])], dim=1)
