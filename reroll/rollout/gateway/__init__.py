"""The OpenAI-compatible gateway that trains unmodified agent harnesses (DESIGN §1, §2): the app
in front of the rollout engine (`app.py`), the per-episode session recorder (`session.py`), chat
rendering and token splicing (`chat.py`), the assembly of a session's calls into trajectories
(`assembly.py`) and the running of agent programs as episodes (`agents.py`)."""

from reroll.rollout.gateway.agents import AgentSpec, GatewayEpisodeStats, run_episodes
from reroll.rollout.gateway.app import Gateway

__all__ = ["AgentSpec", "Gateway", "GatewayEpisodeStats", "run_episodes"]
