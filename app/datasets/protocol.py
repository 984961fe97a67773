"""Wire models of the dataset routes (`/v1/datasets`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field, model_validator

from app.common.protocol import ServerPath, WireModel, field_error, one_of
from app.envs.rewards import reward_names_schema

DatasetName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
RowField = Annotated[str, Field(min_length=1, max_length=256)]


class FieldMap(WireModel):
    """Which field of each row holds what."""

    query: RowField = Field(default="query", description="The prompt (a non-empty string).")
    answer: RowField | None = Field(
        default="answer",
        description="The ground truth (string, number or null); null here for rows without.",
    )
    extra: dict[RowField, RowField] = Field(
        default_factory=dict,
        max_length=64,
        description="Fields rewards read, as {name: field of the row}, e.g. "
        '{"instruction_id_list": "instruction_id_list", "kwargs": "kwargs"} for ifeval.',
    )


class DatasetUpload(WireModel):
    """A JSONL dataset, sent inline or read from a file in the server's import directory."""

    model_config = ConfigDict(json_schema_extra=one_of(("jsonl",), ("path",)))

    name: DatasetName
    jsonl: str | None = Field(default=None, description="The rows, one JSON object per line.")
    path: ServerPath | None = Field(
        default=None,
        description="A JSONL file under the server's RLSERVE_DATASETS__IMPORT_DIR (relative to "
        "it, or absolute inside it).",
    )
    fields: FieldMap = Field(default_factory=FieldMap)
    reward: str | None = Field(
        default=None,
        description="Also check every row's fields for this reward (e.g. ifeval), so a row "
        "it cannot score is refused now rather than when an episode starts.",
        json_schema_extra=reward_names_schema,
    )

    @model_validator(mode="after")
    def _one_source(self) -> DatasetUpload:
        if (self.jsonl is None) == (self.path is None):
            raise field_error("jsonl", "give exactly one of jsonl or path")
        return self


class DatasetInfo(WireModel):
    name: str
    rows: int
    size_bytes: int = Field(description="The JSONL's size (0 for bundled datasets).")
    fields: list[str] = Field(description="The extra fields each row carries.")
    bundled: bool = Field(description="Every key sees it; it cannot be deleted.")
    created_at: float | None = None


class DatasetList(WireModel):
    datasets: list[DatasetInfo]
