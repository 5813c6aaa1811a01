"""What several tests share: the repository's root, toy-size configs, and
references and scripts that are not tests themselves."""

import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
