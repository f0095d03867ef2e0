"""Where a file-writing monitor puts its files: `output_path/job_name` (upstream's layout;
an empty output_path is the launch directory)."""

from __future__ import annotations

import os
from typing import Any


def log_dir(section: Any) -> str:
    path = os.path.join(section.output_path or "", section.job_name)
    os.makedirs(path, exist_ok=True)
    return path
