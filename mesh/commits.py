"""The check that a completion's SHA names a commit in a given git repository."""

from __future__ import annotations

import subprocess
from pathlib import Path

from bus.errors import ConfigError, InvalidEvent, Unavailable

GIT_TIMEOUT_S = 10.0


def require_commit(repo: Path, sha: str, *, task: str) -> None:
    """Raise InvalidEvent unless `sha` names a commit in the git repository at `repo` (ConfigError when
    `repo` is not a git repository)."""
    try:
        probe = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--git-dir"],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
    except FileNotFoundError as e:
        raise ConfigError("--repo", "git is not installed; install git or complete without --repo") from e
    except subprocess.TimeoutExpired as e:
        raise Unavailable("git", f"`git rev-parse` in {repo} took over {GIT_TIMEOUT_S:.0f}s; retry") from e
    if probe.returncode != 0:
        raise ConfigError("--repo", f"{repo} is not a git repository ({probe.stderr.strip()})")
    try:
        found = subprocess.run(
            ["git", "-C", str(repo), "cat-file", "-e", f"{sha}^{{commit}}"],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise Unavailable("git", f"`git cat-file` in {repo} took over {GIT_TIMEOUT_S:.0f}s; retry") from e
    if found.returncode != 0:
        raise InvalidEvent(
            f"task {task} complete.sha={sha!r}", f"is not a commit in {repo}; push or fetch it, or check the SHA"
        )
