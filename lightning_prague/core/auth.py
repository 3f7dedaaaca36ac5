"""Who may talk to the control plane: the job's secret, the launch's id, and the handshake's proofs.

The control plane's port is reachable by whoever reaches the node (other users' jobs, port scanners,
monitoring probes), so every connection proves that it belongs to this launch of this job before
anything else of it is read:

1. the plane writes a challenge: a fresh random nonce and the launch's id (`CHALLENGE`);
2. the client checks that the launch is its own (when it knows its own) and answers with `hello`:
   its rank, a nonce of its own, and `hello_proof` (an HMAC-SHA256 of both nonces and the rank under
   the launch's key); the plane checks it (`proof_holds`, constant time) and binds the rank to the
   connection;
3. the plane answers with `welcome_proof`, which the client checks: a rank never attaches to a
   plane that does not hold the key (another job's, or an earlier launch's that still holds a
   fixed port).

A replayed `hello` fails (the plane's nonce is new on every connection). The key of a launch is
derived from the job's secret and the launch's id (`Credentials.derive`), so the same secret gives
every launch another key. The secret is the user's (`SECRET_VARIABLE` or `SECRET_FILE_VARIABLE`,
on every rank) or, without one, one that global rank 0 generates and hands to the ranks through the
store, as the store hands them everything else (no weaker than PyTorch's store, which is
unauthenticated; see `docs/security.md`). Nothing is encrypted: the control plane carries
coordination, no data and no secret.

Standard library only (`hmac`, `hashlib`, `secrets`): both sides of the handshake import it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from lightning_prague.core.errors import ConfigurationError

#: environment variable: the job's secret itself (the same on every rank)
SECRET_VARIABLE = "LIGHTNING_PRAGUE_SECRET"
#: environment variable: a file that holds the job's secret (readable by its owner only)
SECRET_FILE_VARIABLE = "LIGHTNING_PRAGUE_SECRET_FILE"
#: environment variable: this launch's id (set by the strategies for Lightning's own launcher)
LAUNCH_VARIABLE = "LIGHTNING_PRAGUE_LAUNCH_ID"
#: the shortest secret accepted, characters
MIN_SECRET_CHARS = 16
#: the longest launch id, characters
MAX_LAUNCH_CHARS = 256


def user_secret() -> bytes | None:
    """The secret the user set (`SECRET_VARIABLE`, else the file `SECRET_FILE_VARIABLE` names), or `None`.

    Raises `ConfigurationError` for a secret shorter than `MIN_SECRET_CHARS`, a file that cannot be
    read, or a file that others than its owner may read (as ssh refuses such a key).
    """
    value = os.environ.get(SECRET_VARIABLE)
    source = SECRET_VARIABLE
    if not value:
        path = os.environ.get(SECRET_FILE_VARIABLE)
        if not path:
            return None
        source = f"{SECRET_FILE_VARIABLE}={path}"
        try:
            mode = os.stat(path).st_mode
            value = Path(path).read_text().strip()
        except OSError as err:
            raise ConfigurationError(f"{source}: cannot read the job's secret ({err})") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigurationError(
                f"{source}: the file may be read by other users (mode {stat.filemode(mode)}); make it readable by its "
                f"owner only (chmod 600 {path})"
            )
    value = value.strip()
    if len(value) < MIN_SECRET_CHARS:
        raise ConfigurationError(
            f"{source}: the job's secret has {len(value)} characters; use at least {MIN_SECRET_CHARS} random ones "
            "(e.g. `head -c 32 /dev/urandom | base64`)"
        )
    return value.encode()


def secret_advice(nodes: int) -> str | None:
    """What to say at the start of a job of `nodes` nodes whose user set no secret (`None`: nothing):
    the generated one travels through the job's store, which has no authentication, across a network."""
    if nodes < 2 or user_secret() is not None:
        return None
    return (
        f"this job runs on {nodes} nodes without a secret of its own: the one rank 0 generates travels through "
        f"the job's store, which anyone who reaches MASTER_PORT can read. Set {SECRET_FILE_VARIABLE} (a file "
        f"only you can read, on every node) or {SECRET_VARIABLE} in every rank's environment (docs/security.md, "
        "The secret; the example job scripts make one per job)"
    )


def generated_secret() -> str:
    """A fresh secret for a job whose user set none (rank 0 hands it out through the store)."""
    return secrets.token_hex(32)


def known_launch_id() -> str | None:
    """This job's id as its launcher tells it (the same on every rank of the job), or `None`.

    The id names one *job*: every process that may take part in one fit, including a lost rank's
    new process, has the same id, and a process of another job (a requeue, a new allocation that
    reuses the port, another torchrun run) has another one (docs/multi_node.md, "A job's identity"):

    - `LAUNCH_VARIABLE`, set by the user (e.g. a Kubernetes Job's uid) or by the strategies'
      launcher for the ranks it starts (one start of the script);
    - torchrun: its run id and restart count (`torchrun:<run id>:<restart count>`): a torchrun restart
      is a new fit of every worker;
    - SLURM: the job's id and its requeue count (`slurm:<job id>:<restart count>`). The step id is not
      part of it: a new `srun` step of the same job (a lost task started again) belongs to the job,
      while a requeued job (`SLURM_RESTART_COUNT` higher) starts a fresh fit.

    `None` for ranks started by hand (they take the id the supervisor published; a process of them
    rejoins a running fit only when told to: `LIGHTNING_PRAGUE_REJOIN=1`).
    """
    env = os.environ
    if env.get(LAUNCH_VARIABLE):
        launch = env[LAUNCH_VARIABLE]
    elif env.get("TORCHELASTIC_RUN_ID"):
        launch = f"torchrun:{env['TORCHELASTIC_RUN_ID']}:{env.get('TORCHELASTIC_RESTART_COUNT', '0') or '0'}"
    elif env.get("SLURM_JOB_ID"):
        launch = f"slurm:{env['SLURM_JOB_ID']}:{env.get('SLURM_RESTART_COUNT', '0') or '0'}"
    else:
        return None
    if len(launch) > MAX_LAUNCH_CHARS:
        raise ConfigurationError(f"the launch id {launch[:40]!r}... is longer than {MAX_LAUNCH_CHARS} characters")
    return launch


def new_launch_id() -> str:
    """A launch id for a launch whose launcher gave none."""
    return f"prague:{secrets.token_hex(16)}"


def new_nonce() -> str:
    """A handshake's nonce: 32 random bytes, hexadecimal."""
    return secrets.token_hex(32)


@dataclass(frozen=True)
class Credentials:
    """What both sides of a connection hold: this launch's id and its key."""

    launch: str
    key: bytes

    @staticmethod
    def derive(secret: bytes, launch: str) -> Credentials:
        """The credentials of launch `launch` of the job whose secret is `secret`."""
        return Credentials(launch, hmac.new(secret, b"lightning-prague launch\0" + launch.encode(), "sha256").digest())

    @staticmethod
    def generate() -> Credentials:
        """Credentials of a fresh secret and launch (tests, and a plane used inside one process)."""
        return Credentials.derive(generated_secret().encode(), new_launch_id())

    def _proof(self, what: bytes, server_nonce: str, client_nonce: str, rank: int) -> str:
        message = b"\0".join((what, server_nonce.encode(), client_nonce.encode(), str(rank).encode()))
        return hmac.new(self.key, message, hashlib.sha256).hexdigest()

    def hello_proof(self, server_nonce: str, client_nonce: str, rank: int) -> str:
        """The client's proof that it holds the key (its `hello`)."""
        return self._proof(b"hello", server_nonce, client_nonce, rank)

    def welcome_proof(self, server_nonce: str, client_nonce: str, rank: int) -> str:
        """The plane's proof that it holds the key (its `welcome`)."""
        return self._proof(b"welcome", server_nonce, client_nonce, rank)


def proof_holds(expected: str, given: str) -> bool:
    """Whether `given` is `expected`, in time that does not depend on where they differ."""
    return hmac.compare_digest(expected.encode(), given.encode())
