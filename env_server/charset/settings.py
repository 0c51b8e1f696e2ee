"""The charset task's settings: fields of the env server's settings (``DELTARL_ENV_*``, the
run config's ``[env]``), declared here, where the task is."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

if TYPE_CHECKING:  # the environment loads with the task, not with the client's wire models
    from deltarl.env_server.charset.environment import CharsetRules


class CharsetSettings(BaseModel):
    """The target set and length of the replies the server scores when ``task = "charset"``."""

    charset_target: str = Field(
        default="abcdefghijklmnopqrstuvwxyz",
        min_length=1,
        description="Charset task: the characters that score.",
    )
    charset_min_chars: int = Field(
        default=8,
        ge=1,
        le=10_000,
        description="Charset task: replies shorter than this count as this long (full marks "
        "need at least this many characters, all in the set).",
    )

    def charset_rules(self) -> CharsetRules:
        """The charset task's rules these settings select."""
        from deltarl.env_server.charset.environment import CharsetRules

        return CharsetRules(target=self.charset_target, min_chars=self.charset_min_chars)
