"""Version of this package: the DeepSpeed API level we match, plus a local build label."""

__version__ = "0.19.8+pure.1"
version = __version__
git_hash = None
git_branch = None
