"""Offline installs: a wheelhouse (a folder of wheels) for a target interpreter and platform.

Pure functions for ``noxfile.py``'s ``wheelhouse`` session (stdlib and ``packaging``: no torch). Steps
(docs/clusters.md): pin the roots with ``uv pip compile`` excluding what the target provides, ``pip download
--no-deps`` (sdists built into wheels), resolve offline from the folder with stand-ins for provided packages
(:func:`verify_command`), write :func:`manifest`. :func:`install_args` leaves an installed torch alone.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import re
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

#: Never carried: the machine's CUDA torch and its companions, and TransformerEngine (source-only binding, DESIGN.md 9).
ALWAYS_EXCLUDED = ("torch", "triton", "transformer-engine", "transformer-engine-torch", "transformer-engine-cu12",
                   "transformer-engine-cu13")
#: Name prefixes never carried: the CUDA libraries torch and TransformerEngine pull in.
EXCLUDED_PREFIXES = ("nvidia-",)
#: Extras that cannot go in a wheelhouse, with the reason.
UNCARRIABLE_EXTRAS = {"gpu": "TransformerEngine's PyTorch binding is source-only and builds against CUDA"}
#: The GPU machine's torch (DESIGN.md 9), assumed by the offline check.
DEFAULT_PRESENT = {"torch": "2.11.0"}

# The manylinux glibc minors uv's --python-platform accepts.
_UV_MANYLINUX_MINORS = (17, 28, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40)
# PEP 599 / 571 / 513 legacy names and the glibc they stand for.
_LEGACY_MANYLINUX = {"manylinux2014": 17, "manylinux2010": 12, "manylinux1": 5}
_MANYLINUX_RE = re.compile(r"^manylinux_(\d+)_(\d+)_(\w+)$")
_LEGACY_RE = re.compile(r"^(manylinux2014|manylinux2010|manylinux1)_(\w+)$")
#: Modules a run imports beyond torch and the suite (:func:`check_requirements`).
REQUIRED_MODULES: dict[str, str] = {
    "megatron.core": "megatron-core==0.16.1", "omegaconf": "omegaconf==2.4.0", "zstandard": "zstandard",
    "scipy": "scipy", "numpy": "numpy", "tabulate": "tabulate", "tqdm": "tqdm", "yaml": "pyyaml",
}


def is_excluded(name: str, present: Iterable[str] = ()) -> bool:
    """Whether a distribution (any spelling) stays out: :data:`ALWAYS_EXCLUDED`, ``nvidia-*``, or in ``present``."""
    canon = canonicalize_name(name)
    return (canon in ALWAYS_EXCLUDED or canon.startswith(EXCLUDED_PREFIXES)
            or canon in {canonicalize_name(p) for p in present})


def manylinux_glibc(platform: str) -> tuple[int, str]:
    """``(28, "x86_64")`` for ``manylinux_2_28_x86_64`` (PEP 600) or a legacy tag; ValueError otherwise."""
    if m := _MANYLINUX_RE.match(platform):
        if int(m.group(1)) != 2:
            raise ValueError(f"platform '{platform}': only glibc 2.x manylinux tags exist")
        return int(m.group(2)), m.group(3)
    if m := _LEGACY_RE.match(platform):
        return _LEGACY_MANYLINUX[m.group(1)], m.group(2)
    raise ValueError(f"platform '{platform}' is not a manylinux tag; valid: manylinux_2_<minor>_<arch> (e.g. "
                     f"manylinux_2_28_x86_64), {', '.join(k + '_<arch>' for k in _LEGACY_MANYLINUX)}")


def manylinux_platforms(platform: str) -> list[str]:
    """Every tag a machine of ``platform``'s glibc runs, newest first (pip's ``--platform`` matches exactly)."""
    minor, arch = manylinux_glibc(platform)
    alias = {m: f"{legacy}_{arch}" for legacy, m in _LEGACY_MANYLINUX.items()}
    # The order packaging.tags gives a machine of that glibc.
    return [tag for m in range(minor, 4, -1) for tag in (f"manylinux_2_{m}_{arch}", alias.get(m)) if tag]


@dataclass(frozen=True)
class WheelhouseTarget:
    """The target interpreter (CPython ``MAJOR.MINOR``) and manylinux tag (glibc floor)."""

    python: str = "3.12"
    platform: str = "manylinux_2_28_x86_64"
    implementation: str = "cp"

    def __post_init__(self) -> None:
        if not re.fullmatch(r"3\.\d{1,2}", self.python):
            raise ValueError(f"python must be MAJOR.MINOR such as 3.12, got '{self.python}'")
        if self.implementation != "cp":
            raise ValueError(f"implementation must be 'cp' (CPython), got '{self.implementation}'")
        minor, _ = manylinux_glibc(self.platform)
        if minor < _UV_MANYLINUX_MINORS[0]:
            raise ValueError(f"platform '{self.platform}': glibc 2.{minor} is older than the oldest "
                             f"resolvable (2.{_UV_MANYLINUX_MINORS[0]})")

    @property
    def abi(self) -> str:
        """The CPython ABI tag, ``cp312`` for 3.12."""
        return "cp" + self.python.replace(".", "")

    @property
    def platforms(self) -> list[str]:
        """pip ``--platform`` values (:func:`manylinux_platforms`)."""
        return manylinux_platforms(self.platform)

    @property
    def uv_platform(self) -> str:
        """uv's ``--python-platform``: the newest glibc uv knows, not newer than the target's."""
        minor, arch = manylinux_glibc(self.platform)
        usable = max(m for m in _UV_MANYLINUX_MINORS if m <= minor)
        return f"{arch}-manylinux2014" if usable == 17 else f"{arch}-manylinux_2_{usable}"

    def pip_target_args(self) -> list[str]:
        """pip's interpreter/platform restriction options for this target."""
        platforms = [arg for tag in self.platforms for arg in ("--platform", tag)]
        return ["--python-version", self.python, "--implementation", self.implementation, "--abi", self.abi, *platforms]


def _pins(lines: Iterable[str], what: str, skip_urls: bool = False) -> Iterator[tuple[str, str]]:
    """``(canonical name, version)`` of each ``NAME==VERSION`` line; comments and ``-`` options skipped, ``NAME @
    URL`` too with ``skip_urls``; any other line is a ValueError naming it as ``what``."""
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-") or (skip_urls and " @ " in line):
            continue
        try:
            req = Requirement(line)
            specs = list(req.specifier)
        except InvalidRequirement:
            specs = []
        if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
            raise ValueError(f"{what} '{line}' is not pinned to one version (NAME==VERSION)")
        yield canonicalize_name(req.name), specs[0].version


def parse_present(lines: Iterable[str]) -> dict[str, str]:
    """``{name: version}`` from ``pip freeze`` lines (``-e``, ``@ URL`` skipped; other non-pins: ValueError)."""
    return dict(_pins(lines, "present package", skip_urls=True))


def project_requirements(
    pyproject: Mapping, extras: Sequence[str] = (), present: Iterable[str] = (), with_nox: bool = False,
    drop_excluded: bool = True,
) -> list[str]:
    """The wheelhouse roots: dependencies, ``extras`` and build requirements (an editable install builds).

    Args:
        pyproject: the parsed ``pyproject.toml``.
        extras: optional-dependency groups to add (``eval``, ``dev``).
        present: names the target provides; left out like :data:`ALWAYS_EXCLUDED`.
        with_nox, drop_excluded: add nox (``dev``'s pin); drop excluded and present packages (False: offline check).

    Returns:
        Requirement strings, in pyproject order, without duplicates.

    Raises:
        ValueError: an unknown extra (lists the valid ones) or one that cannot be carried (``gpu``).
    """
    project = pyproject["project"]
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra in UNCARRIABLE_EXTRAS:
            raise ValueError(f"extra '{extra}' cannot go in a wheelhouse: {UNCARRIABLE_EXTRAS[extra]}")
        if extra not in optional:
            raise ValueError(f"unknown extra '{extra}'; valid: {', '.join(k for k in optional if k not in UNCARRIABLE_EXTRAS)}")
    roots = list(project.get("dependencies", []))
    for extra in extras:
        roots += optional[extra]
    if with_nox:
        roots += [r for r in optional.get("dev", []) if canonicalize_name(Requirement(r).name) == "nox"] or ["nox"]
    roots += pyproject.get("build-system", {}).get("requires", [])
    present = list(present)
    kept = [req for req in roots if not drop_excluded or not is_excluded(Requirement(req).name, present)]
    return list(dict.fromkeys(kept))


def uv_compile_command(
    requirements_in: str | Path, excludes: str | Path, output: str | Path, target: WheelhouseTarget, uv: str = "uv"
) -> list[str]:
    """``uv pip compile`` of the roots for ``target``, ``excludes`` (and their dependencies) left out."""
    return [uv, "pip", "compile", str(requirements_in), "--python-version", target.python,
            "--python-platform", target.uv_platform, "--excludes", str(excludes), "--no-header",
            "--no-annotate", "--output-file", str(output)]


def parse_pins(text: str) -> list[tuple[str, str]]:
    """``(canonical name, version)`` of each line of a compiled requirements file (ValueError: one not pinned)."""
    return [(name, str(Version(version))) for name, version in _pins(text.splitlines(), "compiled requirement")]


def download_command(requirements: str | Path, dest: str | Path, target: WheelhouseTarget, pip: Sequence[str] = ("pip",)) -> list[str]:
    """``pip download`` of the pins for ``target``; ``--no-deps`` lets pip take sdists under ``--platform``."""
    return [*pip, "download", "--no-deps", *target.pip_target_args(), "--dest", str(dest), "-r", str(requirements)]


def build_command(sdists: Sequence[str | Path], dest: str | Path, pip: Sequence[str] = ("pip",)) -> list[str]:
    return [*pip, "wheel", "--no-deps", "--wheel-dir", str(dest), *map(str, sdists)]


def is_sdist(filename: str) -> bool:
    return filename.endswith((".tar.gz", ".zip"))


def is_pure_wheel(filename: str) -> bool:
    """Whether every tag of a wheel is interpreter-independent (``none`` ABI, ``any`` platform)."""
    _, _, _, tags = parse_wheel_filename(filename)
    return all(t.abi == "none" and t.platform == "any" for t in tags)


def distribution_name(filename: str) -> tuple[str, str]:
    """``(canonical name, version)`` of a wheel or sdist file name."""
    if filename.endswith(".whl"):
        name, version, _, _ = parse_wheel_filename(filename)
    else:
        name, version = parse_sdist_filename(filename)
    return canonicalize_name(name), str(version)


def placeholder_wheel(name: str, version: str, dest: str | Path, requires: Sequence[str] = ()) -> Path:
    """An empty wheel in ``dest`` standing in for a package the target has (:func:`verify_command`); its path."""
    dist = re.sub(r"[-_.]+", "_", name)
    info = f"{dist}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {
        f"{info}/METADATA": metadata,
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: dirmoe-bench\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    out = Path(dest) / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return out


def verify_command(requirements_in: str | Path, find_links: Sequence[str | Path], scratch: str | Path,
                   target: WheelhouseTarget, pip: Sequence[str] = ("pip",)) -> list[str]:
    """Offline dry-run resolve of the roots from ``find_links`` only (``--isolated``: no configured index)."""
    links = [arg for d in find_links for arg in ("--find-links", str(d))]
    return [*pip, "--isolated", "install", "--dry-run", "--ignore-installed", "--no-index", *links,
            "--only-binary=:all:", *target.pip_target_args(), "--target", str(scratch), "-r", str(requirements_in)]


def install_args(wheelhouse: str | Path, spec: str = ".", editable: bool = True) -> list[str]:
    """``pip install`` options installing ``spec`` from the folder alone (no index)."""
    return ["--no-index", "--find-links", str(wheelhouse), *(["-e"] if editable else []), spec]


def manifest(
    wheel_dir: str | Path, target: WheelhouseTarget, extras: Sequence[str], roots: Sequence[str],
    present: Mapping[str, str], built: Iterable[str] = (), left_out: Iterable[str] = (),
) -> dict:
    """A wheelhouse's ``manifest.json``: target, extras, roots, packages left out, each wheel, total size."""
    built = set(built)
    wheels = []
    for path in sorted(Path(wheel_dir).glob("*.whl")):
        name, version = distribution_name(path.name)
        wheels.append({"name": name, "version": version, "file": path.name, "bytes": path.stat().st_size,
                       "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "built_from_sdist": path.name in built})
    return {
        "target": {"python": target.python, "platform": target.platform, "implementation": target.implementation,
                   "platforms": target.platforms},
        "extras": list(extras), "roots": list(roots), "present_on_target": dict(sorted(present.items())),
        "excluded_always": [*ALWAYS_EXCLUDED, *(p + "*" for p in EXCLUDED_PREFIXES)],
        "left_out_after_resolution": sorted(set(left_out)),
        "wheels": wheels,
        "total_bytes": sum(w["bytes"] for w in wheels),
    }


def check_requirements() -> None:
    """One-line ReproError naming the packages of :data:`REQUIRED_MODULES` this machine lacks."""
    def found(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a missing parent package
            return False

    missing = [package for module, package in REQUIRED_MODULES.items() if not found(module)]
    if missing:
        from repro.errors import ReproError

        raise ReproError(f"missing package(s) {', '.join(missing)}: install them (offline: pip install --no-index "
                         f"--find-links WHEEL_DIR {' '.join(missing)})")
