"""The one place that reads environment variables."""

from __future__ import annotations

import os


def cache_dir() -> str:
    """Where converted checkpoints, the compiled CPU kernels and GEMM timings are cached;
    PARASHIFT_CACHE_DIR overrides ~/.cache/parashift. Created private (0700); refused with a
    RuntimeError naming it when another user owns it or others may write it, since what it
    holds is loaded as code and weights."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "parashift")
    path = os.environ.get("PARASHIFT_CACHE_DIR") or default
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise RuntimeError(f"the cache folder {path} (mode {st.st_mode & 0o777:o}, owner uid "
                           f"{st.st_uid}) must belong to this user (uid {os.getuid()}) and be "
                           f"writable by no one else: chmod 700 it or set PARASHIFT_CACHE_DIR")
    return path


def api_key() -> str | None:
    """PARASHIFT_API_KEY: the HTTP bearer key, kept out of the command line (where every local
    user reads it in /proc/*/cmdline)."""
    return os.environ.get("PARASHIFT_API_KEY") or None


def admin_api_key() -> str | None:
    """PARASHIFT_ADMIN_KEY: the key of the admin routes (sleep, wake, reset, scale), apart from
    the inference key: whoever may generate may not put the server to sleep."""
    return os.environ.get("PARASHIFT_ADMIN_KEY") or None


def cluster_secret() -> str | None:
    """PARASHIFT_CLUSTER_SECRET: the secret every process of a multi-node or Ray deployment
    proves on its tcp links (wire/cluster_auth.py). `run --cluster-secret-file` and the Ray
    launcher set it for their children."""
    return os.environ.get("PARASHIFT_CLUSTER_SECRET") or None


def set_cluster_secret(secret: str) -> None:
    """For this process and the children it starts (Ray actors get it as an argument)."""
    os.environ["PARASHIFT_CLUSTER_SECRET"] = secret


def log_level() -> str:
    return os.environ.get("PARASHIFT_LOG_LEVEL", "INFO").upper()


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1: Triton runs its kernels on CPU tensors (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


