"""The suite writes only into its own temporary folder (tests/conftest.py): a test that reaches the
user's ~/.cache/diffrlhf, ~/.ray or /tmp/ray would go through one of these roots."""
import os
from pathlib import Path

from conftest import SANDBOX


def test_every_cache_root_the_project_and_ray_use_is_inside_the_sandbox():
    from ray._common.utils import get_default_ray_temp_dir

    from diffrlhf.rewards._weights import cache_dir

    roots = [cache_dir(), Path.home(), Path(os.path.expanduser("~/.cache/diffrlhf")), Path(get_default_ray_temp_dir()),
             Path(os.environ["MPLCONFIGDIR"])]
    for root in roots:
        assert SANDBOX in root.resolve().parents, f"{root} is outside the test sandbox {SANDBOX}"
