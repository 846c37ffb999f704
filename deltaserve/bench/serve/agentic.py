"""The agentic workload: multi-turn sessions whose context grows to a target, as a coding agent's does.

A session's first prompt is [unique prefix] + system prompt + tool definitions + a user message; the
system prompt and tool definitions are shared by every session of a concurrency level. Each later
turn's prompt is the previous prompt + the model's answer + a tool result of random length, so
nearly all of it is the previous turn's sequence. The session ends when the next turn (prompt plus
its answer) would pass the target context; its slot then starts a new session.

The answer is appended as the exact token ids the server generated when it returns them (vLLM's
`return_token_ids`), so a server that caches generated tokens can reuse them; otherwise as synthetic
ids of the same length (the lengths stay exact; reuse of the answer then cannot happen). The unique
prefix ("cache bust", on by default, as agentic benchmarks do) makes every session's first turn a
cold prefill: nothing is shared across sessions, so hits come only from a session's own earlier turns.

Everything a session draws comes from generators keyed by (seed, level, session id), in a fixed
order: its lengths and think times from one, its token ids (also keyed by the run's salt, see
`tokens`) from another. So a session's lengths are the same in every run with the same seed,
whatever the server answers or however requests interleave.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from deltaserve.bench.serve import tokens
from deltaserve.bench.serve.records import RequestSpec
from deltaserve.bench.serve.workloads import Workload


@dataclass(frozen=True)
class AgenticConfig:
    """Lengths in tokens; ranges are inclusive (lo, hi), drawn uniformly per turn."""

    system_prompt_len: int = 6000
    tool_definitions_len: int = 6000
    user_prompt_len: int = 500
    tool_result_len: tuple[int, int] = (500, 4000)
    answer_len: tuple[int, int] = (100, 800)
    target_context_len: int = 32768
    think_time_s: tuple[float, float] = (0.0, 0.0)
    cache_bust: bool = True
    cache_bust_len: int = 8
    # send cache_control: {"type": "ephemeral"} on every turn but the one the session knows is its last
    cache_control: bool = False

    def __post_init__(self) -> None:
        for flag, value in (("--agentic-system-len", self.system_prompt_len),
                            ("--agentic-tools-len", self.tool_definitions_len)):
            if value < 0:
                raise ValueError(f"{flag}={value} must be >= 0")
        if self.user_prompt_len < 1:
            raise ValueError(f"--agentic-user-len={self.user_prompt_len} must be at least 1")
        if self.cache_bust and self.cache_bust_len < 1:
            raise ValueError(f"--agentic-cache-bust-len={self.cache_bust_len} must be at least 1")
        for flag, (lo, hi), least in (("--agentic-tool-result-len", self.tool_result_len, 0),
                                      ("--agentic-answer-len", self.answer_len, 1),
                                      ("--agentic-think-time", self.think_time_s, 0)):
            if not least <= lo <= hi:
                raise ValueError(f"{flag}={lo}:{hi} needs {least} <= LO <= HI")

    @property
    def first_prompt_len(self) -> int:
        bust = self.cache_bust_len if self.cache_bust else 0
        return bust + self.system_prompt_len + self.tool_definitions_len + self.user_prompt_len


class AgenticWorkload(Workload):
    """Sessions of one run; `target_context_len` is the configured target capped at the server's limit."""

    name = "agentic"
    mode = "sessions"

    def __init__(self, config: AgenticConfig, vocab_size: int, seed: int, salt: int, max_model_len: int | None,
                 ) -> None:
        super().__init__(vocab_size, seed, salt)
        self.config = config
        target = config.target_context_len
        self.target_context_len = target if max_model_len is None else min(target, max_model_len)
        first_turn = config.first_prompt_len + config.answer_len[1]
        if first_turn > self.target_context_len:
            raise ValueError(
                f"the first turn needs {first_turn} tokens (cache-bust prefix + --agentic-system-len + "
                f"--agentic-tools-len + --agentic-user-len + the longest --agentic-answer-len), more than the "
                f"target context {self.target_context_len} (--agentic-target-context, capped by the server's "
                "max_model_len); shorten them or raise the target"
            )
        self._shared: dict[int, list[int]] = {}

    def describe(self) -> dict:
        return {"name": self.name, **asdict(self.config), "target_context_len_used": self.target_context_len}

    def shared_prefix(self, level: int) -> list[int]:
        """System prompt + tool definitions of one level (the same for all its sessions)."""
        if level not in self._shared:
            c, ns = self.config, self.namespace(level)
            system = ns.tokens(self.vocab_size, c.system_prompt_len, tokens.SYSTEM_PROMPT)
            tools = ns.tokens(self.vocab_size, c.tool_definitions_len, tokens.TOOL_DEFINITIONS)
            self._shared[level] = system + tools
        return self._shared[level]

    def session(self, level: int, session_id: int) -> AgenticSession:
        return AgenticSession(self, level, session_id)


class AgenticSession:
    """One session: `next_request()`, then `add_turn()` with the answer, then `think_time()`, until
    `next_request()` returns None (the target is reached); after a failed turn the runner drops it."""

    def __init__(self, workload: AgenticWorkload, level: int, session_id: int) -> None:
        self.workload = workload
        self.session_id = session_id
        c, vocab = workload.config, workload.vocab_size
        self._namespace = workload.namespace(level)
        self._lengths = self._namespace.length_rng(tokens.SESSION, session_id)
        self._tokens = self._namespace.token_rng(tokens.SESSION, session_id)
        bust = tokens.random_tokens(self._tokens, vocab, c.cache_bust_len) if c.cache_bust else []
        user = tokens.random_tokens(self._tokens, vocab, c.user_prompt_len)
        self.context = bust + workload.shared_prefix(level) + user
        self.turn = 0
        self.done = False

    def next_request(self) -> RequestSpec | None:
        """The next turn, or None once it would pass the target context."""
        if self.done:
            return None
        lo, hi = self.workload.config.answer_len
        answer_len = int(self._lengths.integers(lo, hi + 1))
        if len(self.context) + answer_len > self.workload.target_context_len:
            self.done = True
            return None
        self.turn += 1
        c = self.workload.config
        # as an agent knows it: another turn is possible unless even the shortest tool result and answer
        # after this one would pass the target
        more = len(self.context) + answer_len + c.tool_result_len[0] + lo <= self.workload.target_context_len
        return RequestSpec(list(self.context), answer_len, session_id=self.session_id, turn=self.turn,
                           cache_control=c.cache_control and more)

    def add_turn(self, answer_ids: list[int] | None, answer_len: int) -> bool:
        """Append the answer (the server's ids when it returned all `answer_len` of them, else synthetic
        ids of that length) and a tool result; whether the server's ids were used."""
        vocab = self.workload.vocab_size
        from_server = answer_ids is not None and len(answer_ids) == answer_len
        if from_server:
            answer = answer_ids
        else:  # keyed apart from the session's generators, so what follows does not depend on the server
            answer = self._namespace.tokens(vocab, answer_len, tokens.SESSION_ANSWER, self.session_id, self.turn)
        lo, hi = self.workload.config.tool_result_len
        tool_result = tokens.random_tokens(self._tokens, vocab, int(self._lengths.integers(lo, hi + 1)))
        self.context = self.context + answer + tool_result
        return from_server

    def think_time(self) -> float:
        """Seconds the agent spends before its next turn (running the tool, in a real agent)."""
        lo, hi = self.workload.config.think_time_s
        return float(self._lengths.uniform(lo, hi)) if hi > 0 else 0.0
