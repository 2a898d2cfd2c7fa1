"""What every section of the configuration shares: no unknown fields, no infinities, words as YAML reads them."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, model_validator


class ConfigError(ValueError):
    pass


class _Section(BaseModel):
    # inf/nan pass every bound (lr=.inf is "> 0") and only show up as a NaN loss: refuse them
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _on_off(cls, data: Any) -> Any:
        """A field of words with ``off`` among them (and ``on``) takes them as YAML reads them unquoted: false, true."""
        if isinstance(data, dict):
            for k, v in data.items():
                words = get_args(cls.model_fields[k].annotation) if k in cls.model_fields else ()
                if isinstance(v, bool) and "off" in words and (not v or "on" in words):
                    data = {**data, k: "on" if v else "off"}
        return data
