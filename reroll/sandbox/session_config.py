"""Schemas of sandbox sessions: what one session gets (`SessionSpec`) and the `sessions:` config
section that chooses where sessions run (in this process or through a sandbox service) and
with which defaults (`SessionsConfig`). Plain pydantic models, frozen, unknown keys are errors."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from reroll.sandbox.limits import Limits, SandboxConfig, check_env, parse_size


class SessionSpec(BaseModel):
    """One session's limits and lifetime (the body of a create request)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    limits: Limits = Field(default_factory=Limits)
    """Every limit of a one-shot sandbox, applied per session: the rlimits hold for each of its
    processes, ``wall_time_s``, ``cpu_time_s`` and ``output_bytes`` are each command's defaults
    (an exec may pass its own). ``tmpfs_bytes`` is not used: ``disk_bytes`` covers the
    session's workdir, /tmp and /dev/shm together."""
    disk_bytes: int = Field(256 << 20, ge=1 << 20)
    """Disk quota of the session: its workdir, /tmp and /dev/shm together (one tmpfs of this
    size on the host, kept across commands; as root only, elsewhere not enforced and logged)."""
    disk_inodes: int = Field(16384, ge=64, le=1 << 24)
    """Files, directories and links the session may hold (workdir, /tmp and /dev/shm)."""
    ttl_s: float = Field(3600.0, gt=0, le=7 * 24 * 3600)
    """Time to live from creation: past it the session is closed and its files removed."""
    idle_timeout_s: float = Field(600.0, gt=0, le=7 * 24 * 3600)
    """A session without a request for this long is stopped: its processes end, its files and
    shell state stay, and the next exec starts it again."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables of the session's shell at the start."""

    @field_validator("disk_bytes", mode="before")
    @classmethod
    def _size(cls, value: int | str) -> int:
        return parse_size(value)

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        check_env(value)
        return value


class SessionsConfig(BaseModel):
    """Where sandbox sessions run and their defaults. ``mode: local`` runs them in this process
    (bubblewrap on this machine); ``mode: remote`` asks a `reroll sandbox serve` service at
    ``url``. Environments and rewards use either through the same interface
    (`reroll.sandbox.open_sessions`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["local", "remote"] = "local"
    """``local``: sessions in this process; ``remote``: through the sandbox service at ``url``."""
    url: str | None = None
    """The service's base URL (``http://host:port``); required when ``mode`` is ``remote``."""
    api_key_env: str | None = None
    """Name of the environment variable that holds the service's API key (the key itself never
    sits in a config file). ``None``: no key is sent."""
    request_timeout_s: float = Field(120.0, gt=0)
    """remote: HTTP time limit of one request beyond the exec's own wall clock."""
    session: SessionSpec = Field(default_factory=SessionSpec)
    """Limits and lifetime of a session created without its own."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """local: how the sandboxes are built (the service has its own)."""
    max_sessions: int = Field(1024, ge=1, le=1 << 16)
    """local: sessions alive at once (running or stopped); a create past it is refused."""
    max_starting: int = Field(8, ge=1, le=1024)
    """local: sessions starting at once (bubblewrap, mounts, the shell); more creates wait."""
    warm: int = Field(4, ge=0, le=1024)
    """local: sandboxes started ahead of time for sessions with the default sizes (0: none)."""
    reap_interval_s: float = Field(1.0, gt=0, le=3600)
    """local: how often expired and idle sessions are looked for."""
    max_read_bytes: int = Field(16 << 20, ge=1024)
    """Largest file a read returns."""
    keep_closed: int = Field(4096, ge=0, le=1 << 20)
    """local: closed sessions whose state (and reason) can still be asked for."""

    @field_validator("max_read_bytes", mode="before")
    @classmethod
    def _size(cls, value: int | str) -> int:
        return parse_size(value)

    @model_validator(mode="after")
    def _remote_needs_url(self) -> SessionsConfig:
        if self.mode == "remote" and not self.url:
            raise ValueError("sessions.url is required when sessions.mode is 'remote' (the "
                             "service's http://host:port)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"sessions.url {self.url!r} must start with http:// or https://")
        return self
