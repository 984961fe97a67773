"""Wire models of the environment routes (`/v1/envs`), and their mapping to and from the
domain values the environment service takes and answers (`to_*` and `of`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from app.common.protocol import (
    KeepsNull,
    Message,
    Seed,
    ServedName,
    TokenId,
    WireModel,
    field_error,
    never_together,
    one_of,
)
from app.envs import episodes
from app.envs.engine import RowOutcome, StepResult
from app.envs.rewards import reward_names_schema
from app.envs.sessions import SessionView
from app.envs.spec import EnvSpec
from app.envs.tools import BlockResult
from app.kl.estimators import Estimator

EnvKind = Literal["chat", "text", "tokens"]


class KLPenalty(WireModel):
    coeff: float = Field(default=0.1, ge=0, le=1e6)
    estimator: Estimator = "k1"
    model: ServedName | None = Field(
        default=None,
        description="Whose KL to its reference is penalised: the policy, or one of its LoRA "
        "adapters (against its base with the adapter off). Default: the model that samples the "
        "episodes in /v1/rollouts (`generation.model`), else the policy.",
    )


NOT_CHAT = {"not": {"const": "chat"}}


class EnvConfig(WireModel):
    """An environment session: `batch_size` parallel episodes sharing one configuration."""

    # tools and a system prompt need kind chat, in the schema as in the validator.
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                never_together(kind=NOT_CHAT, system_prompt={"type": "string"}),
                never_together(kind=NOT_CHAT, tools={"type": "array", "minItems": 1}),
            ]
        }
    )

    kind: EnvKind = Field(
        default="chat",
        description="chat: TorchRL ChatEnv (chat template, history). text/tokens: TorchRL "
        "LLMEnv (the action is appended to the observation as a string or token ids).",
    )
    system_prompt: str | None = None
    batch_size: int = Field(default=1, ge=1, le=1024)
    max_turns: int | None = Field(
        default=None,
        ge=1,
        description="Episodes are truncated after this many steps (default and upper bound: "
        "the server's RLSERVE_ENVS__MAX_TURNS).",
    )
    reward: str = Field(
        default="none",
        description="A registered reward (none, gsm8k, number, ifeval, ...), model (the served "
        "reward model's, --reward-model) or judge:NAME (a judge of RLSERVE_REWARDS__JUDGES).",
        json_schema_extra=reward_names_schema,
    )
    reward_options: dict[str, Any] = Field(
        default_factory=dict,
        description="The reward's options, e.g. gsm8k: answer_tag (first | last), "
        "correct_reward, format_reward, set_done_if_answer; ifeval: format_weights, "
        "answer_bonus, think_bonus, scored (answer_tag | response), set_done_if_answer.",
    )
    tools: list[Literal["python"]] = Field(
        default_factory=list, description="python: run fenced python blocks, sandboxed."
    )
    dataset: str | None = Field(
        default=None,
        description="A bundled dataset (arithmetic, ifeval) or one this key uploaded "
        "(POST /v1/datasets).",
    )
    repeats: int = Field(
        default=1, ge=1, description="Each dataset prompt fills this many rows in a row (GRPO)."
    )
    seed: Seed | None = Field(default=None, description="Shuffles the dataset's order.")
    kl: KLPenalty | None = Field(
        default=None, description="Add -coeff * KL(policy||reference) of each turn to its reward."
    )
    hashing: bool = Field(
        default=False, description="Add a stable 64-bit SipHash chain of the observation tokens."
    )

    @model_validator(mode="after")
    def _check(self) -> EnvConfig:
        if self.batch_size % self.repeats:
            raise field_error(
                "repeats", f"{self.repeats} must divide batch_size ({self.batch_size})"
            )
        if self.kind != "chat" and (self.tools or self.system_prompt is not None):
            raise field_error("kind", "tools and system_prompt need kind 'chat'")
        return self

    def to_spec(self) -> EnvSpec:
        return EnvSpec.from_json(self.model_dump())

    @classmethod
    def of(cls, spec: EnvSpec) -> EnvConfig:
        return cls(**spec.to_json())


class EnvCreated(WireModel):
    env_id: str
    config: EnvConfig

    @classmethod
    def of(cls, session: SessionView) -> EnvCreated:
        return cls(env_id=session.env_id, config=EnvConfig.of(session.config))


class ResetRequest(WireModel):
    """Queries (one per row, with optional ground-truth answers and reward fields),
    conversations, or token prompts (kind tokens); nothing draws the next prompts from the
    session's dataset."""

    model_config = ConfigDict(json_schema_extra=lambda schema: _reset_choices(schema))

    query: list[str] | None = None
    answer: list[str | None] | None = None
    fields: list[dict[str, Any]] | None = Field(
        default=None,
        description="Per row, the extra fields the reward reads (as a dataset row carries "
        "them), e.g. ifeval: instruction_id_list and kwargs.",
    )
    messages: list[Annotated[list[Message], Field(min_length=1)]] | None = None
    tokens: list[Annotated[list[TokenId], Field(min_length=1)]] | None = None

    @model_validator(mode="after")
    def _check(self) -> ResetRequest:
        given = [n for n in ("query", "messages", "tokens") if getattr(self, n) is not None]
        if len(given) > 1:
            raise field_error(given[1], f"give at most one of query, messages, tokens; got {given}")
        if self.answer is not None and self.query is None and self.tokens is None:
            raise field_error("answer", "needs query or tokens")
        return self

    def to_prompts(self) -> episodes.Prompts:
        messages = None
        if self.messages is not None:
            messages = [[m.model_dump() for m in conv] for conv in self.messages]
        return episodes.Prompts(
            query=self.query,
            answer=self.answer,
            fields=self.fields,
            messages=messages,
            tokens=self.tokens,
        )


def _reset_choices(schema: dict[str, Any]) -> None:
    """At most one of query, messages and tokens; `answer` only with query or tokens."""
    one_of(("query",), ("messages",), ("tokens",), optional=True)(schema)
    for choice in schema["oneOf"]:
        if "query" not in choice.get("required", ()) and "tokens" not in choice.get("required", ()):
            choice["properties"]["answer"] = {"type": "null"}


class Observation(WireModel):
    history: list[Message] | None = Field(default=None, description="Chat environments.")
    text: str | None = Field(default=None, description="text/tokens environments.")
    prompt_text: str = Field(description="What to generate from (templated for chat).")
    prompt_tokens: list[int] = Field(description="Exact ids to send to /v1/generate.")
    hash: int | None = Field(default=None, description="SipHash chain of prompt_tokens.")

    @classmethod
    def of(cls, observation: episodes.Observation) -> Observation:
        """Built without validation: every field comes from the session's own state (its
        messages were validated on the way in, its ids are the model's). Validating the whole
        history and every id again was the largest part of building a step's answer."""
        history = observation.history
        messages = None
        if history is not None:
            messages = [
                Message.model_construct(role=m["role"], content=m["content"]) for m in history
            ]
        return cls.model_construct(
            history=messages,
            text=observation.text,
            prompt_text=observation.prompt_text,
            prompt_tokens=observation.prompt_tokens,
            hash=observation.hash,
        )


class ResetResponse(WireModel):
    env_id: str
    observations: list[Observation]

    @classmethod
    def of(cls, env_id: str, observations: list[episodes.Observation]) -> ResetResponse:
        return cls(env_id=env_id, observations=[Observation.of(o) for o in observations])


class Action(WireModel):
    model_config = ConfigDict(json_schema_extra=one_of(("text",), ("tokens",)))

    text: str | None = None
    tokens: list[TokenId] | None = None

    @model_validator(mode="after")
    def _one(self) -> Action:
        if (self.text is None) == (self.tokens is None):
            raise field_error("actions", "each action has exactly one of text or tokens")
        return self

    def to_act(self) -> episodes.Act:
        return episodes.Act(self.text, self.tokens)


class StepRequest(WireModel):
    actions: list[Action | None] = Field(
        description="One per row; null for rows whose episode is done."
    )

    def to_acts(self) -> list[episodes.Act | None]:
        return [None if a is None else a.to_act() for a in self.actions]


class ToolResult(WireModel):
    block: int
    ok: bool
    output: str

    @classmethod
    def of(cls, result: BlockResult) -> ToolResult:
        return cls(block=result.block, ok=result.ok, output=result.output)


class StepOutput(KeepsNull):
    kept_null = ("reward",)

    observation: Observation
    reward: float | None = Field(
        description="None when a judge gave no score (info.reward.reward_error says why): the "
        "trainer decides what such a row counts for."
    )
    done: bool
    terminated: bool
    truncated: bool
    info: dict[str, object]

    @classmethod
    def of(cls, outcome: RowOutcome) -> StepOutput:
        return cls(
            observation=Observation.of(outcome.observation),
            reward=outcome.reward,
            done=outcome.done,
            terminated=outcome.terminated,
            truncated=outcome.truncated,
            info=step_info(outcome),
        )


def step_info(outcome: RowOutcome) -> dict[str, object]:
    """A row's step info: the tool results (when tools ran), the answer, the reward breakdown."""
    if outcome.tool_results is None:
        return dict(outcome.info)
    results = [ToolResult.of(r).model_dump() for r in outcome.tool_results]
    return {"tool_results": results, **outcome.info}


class StepResponse(WireModel):
    env_id: str
    policy_version: int
    outputs: list[StepOutput]

    @classmethod
    def of(cls, result: StepResult) -> StepResponse:
        outputs = [StepOutput.of(o) for o in result.outputs]
        return cls(env_id=result.env_id, policy_version=result.policy_version, outputs=outputs)


class RowState(WireModel):
    turns: int
    done: bool
    terminated: bool
    truncated: bool
    total_reward: float | None = Field(
        description="The sum of the episode's rewards; None once a turn had none."
    )

    @classmethod
    def of(cls, row: episodes.Row) -> RowState:
        return cls(
            turns=row.turns,
            done=row.done,
            terminated=row.terminated,
            truncated=row.truncated,
            total_reward=row.total_reward,
        )


class EnvState(WireModel):
    env_id: str
    config: EnvConfig
    started: bool
    rows: list[RowState]
    created_at: float
    updated_at: float

    @classmethod
    def of(cls, session: SessionView) -> EnvState:
        return cls(
            env_id=session.env_id,
            config=EnvConfig.of(session.config),
            started=session.started,
            rows=[RowState.of(r) for r in session.rows],
            created_at=session.created_at,
            updated_at=session.updated_at,
        )


class EnvList(WireModel):
    envs: list[EnvState]
    total: int
    offset: int
    limit: int

    @classmethod
    def of(cls, sessions: list[SessionView], total: int, offset: int, limit: int) -> EnvList:
        envs = [EnvState.of(s) for s in sessions]
        return cls(envs=envs, total=total, offset=offset, limit=limit)
