"""JupyterLab and git: saving a notebook whose only changes are outputs leaves ``git status`` clean.

The nbstripout filter (``.gitattributes``, set up by ``make setup``) removes outputs before git
compares or commits a notebook. Git runs the filter only when it looks at a file's content,
though, and a file whose size differs from what its index recorded is reported as modified
without a look. So after a student runs and saves a notebook, ``git status`` lists it although
``git diff`` shows nothing. ``refresh_git_index`` is a Jupyter server post-save hook
(``make setup`` registers it for the project's environment) that closes this gap: when the saved
notebook, filtered, equals what the index holds, it re-adds it, which changes no content and
only refreshes the index's record of the file. A notebook with real changes is left alone: what
a user stages stays theirs to stage.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

GIT_TIMEOUT_S = 30
log = logging.getLogger(__name__)


def _git(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=GIT_TIMEOUT_S)


def refresh_git_index(model: dict | None = None, os_path: str | os.PathLike = "", contents_manager=None, **_) -> bool:
    """Post-save hook (``ContentsManager.post_save_hook``). Returns True when it refreshed the index.

    It never raises: a failed save hook must not look like a failed save.
    """
    path = Path(os_path)
    if path.suffix != ".ipynb" or not path.is_file():
        return False
    try:
        where = path.parent
        if _git(["rev-parse", "--is-inside-work-tree"], where).stdout.strip() != "true":
            return False
        attr = _git(["check-attr", "filter", "--", path.name], where).stdout
        if not attr.rstrip().endswith(": nbstripout") or _git(["config", "filter.nbstripout.clean"], where).returncode:
            return False  # not a filtered notebook, or the filter is not set up here: nothing to hide
        if _git(["ls-files", "--error-unmatch", "--", path.name], where).returncode:
            return False  # untracked
        if _git(["diff", "--quiet", "--", path.name], where).returncode != 0:
            return False  # real changes (or an error): leave the index as it is
        return _git(["add", "--", path.name], where).returncode == 0
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("ddpm_core.lab: could not refresh git's index for %s: %s", path, e)
        return False
