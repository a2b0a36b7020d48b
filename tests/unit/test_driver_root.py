"""Finding the driver's files: fake driver roots built in tmp dirs (regular files and
symlinks), device nodes through an injected stat or against /dev/null."""

from __future__ import annotations

import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest

from dra_driver import driver_root as dr
from dra_driver.driver_root import device_nodes, paths, user_space

X86 = "x86_64"
VERSION = "580.159.04"


def elf(path: Path, *, machine: int = 62, elf_class: int = 2) -> Path:
    """A file whose header says: ELF, 64- (or 32-) bit, little endian, this machine."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = b"\x7fELF" + bytes([elf_class, 1, 1]) + bytes(9) + (3).to_bytes(2, "little")
    header += machine.to_bytes(2, "little") + bytes(44)
    path.write_bytes(header)
    return path


def link(path: Path, target: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


def driver_lib(d: Path, lib: str, soname_suffix: str | None = "1", version: str = VERSION) -> None:
    """<lib>.<version> (real), <lib>.<soname_suffix> -> real, <lib> -> soname link: the
    layout of /usr/local/nvidia/lib64 on the H200 host."""
    elf(d / f"{lib}.{version}")
    if soname_suffix is not None:
        link(d / f"{lib}.{soname_suffix}", f"{lib}.{version}")
        link(d / lib, f"{lib}.{soname_suffix}")
    else:
        link(d / lib, f"{lib}.{version}")


def h200_root(root: Path) -> Path:
    """The H200 host's /usr/local/nvidia: lib -> lib64, bin/, firmware/nvidia/<version>/."""
    lib64 = root / "lib64"
    driver_lib(lib64, "libcuda.so")
    driver_lib(lib64, "libnvidia-ml.so")
    driver_lib(lib64, "libnvidia-nvvm.so", soname_suffix="4")
    driver_lib(lib64, "libnvidia-gpucomp.so", soname_suffix=None)
    driver_lib(lib64, "libnvidia-eglcore.so", soname_suffix=None)  # graphics: not wanted
    link(root / "lib", "lib64")
    for b in ("nvidia-smi", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"):
        elf(root / "bin" / b).chmod(0o755)
    (root / "firmware" / "nvidia" / VERSION).mkdir(parents=True)
    return root


def by_name(libs: tuple[user_space.DriverLibrary, ...]) -> dict[str, user_space.DriverLibrary]:
    return {os.path.basename(lib.host_path).split(".so")[0]: lib for lib in libs}


# --------------------------------------------------------------------------- resolve


def test_absolute_symlinks_resolve_inside_the_root_not_on_this_host(tmp_path: Path) -> None:
    driver_lib(tmp_path / "usr/local/nvidia/lib64", "libcuda.so")
    link(tmp_path / "lib/libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1")
    assert (
        paths.resolve_in_root(str(tmp_path), "/lib/libcuda.so.1")
        == f"/usr/local/nvidia/lib64/libcuda.so.{VERSION}"
    )


def test_resolve_cannot_climb_out_of_the_root(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "marker").write_text("inside")
    link(tmp_path / "a" / "up", "../../../../../../etc/marker")
    assert paths.resolve_in_root(str(tmp_path), "a/up") == "/etc/marker"


def test_resolve_reports_missing_files_and_loops(tmp_path: Path) -> None:
    link(tmp_path / "x", "y")
    link(tmp_path / "y", "x")
    assert paths.resolve_in_root(str(tmp_path), "x") is None
    assert paths.resolve_in_root(str(tmp_path), "nope/libcuda.so") is None


# --------------------------------------------------------------------------- libraries


def test_h200_layout_libraries_with_real_file_and_link_names(tmp_path: Path) -> None:
    root = h200_root(tmp_path / "nvidia")
    libs = by_name(user_space.scan_libraries(str(root), "/usr/local/nvidia", machine=X86))
    assert set(libs) == {"libcuda", "libnvidia-ml", "libnvidia-nvvm", "libnvidia-gpucomp"}
    cuda = libs["libcuda"]
    assert cuda.host_path == f"/usr/local/nvidia/lib64/libcuda.so.{VERSION}"
    assert cuda.names == ("libcuda.so", "libcuda.so.1", f"libcuda.so.{VERSION}")
    assert libs["libnvidia-nvvm"].names == (
        "libnvidia-nvvm.so",
        "libnvidia-nvvm.so.4",
        f"libnvidia-nvvm.so.{VERSION}",
    )
    assert libs["libnvidia-gpucomp"].names == ("libnvidia-gpucomp.so", f"libnvidia-gpucomp.so.{VERSION}")


def test_library_found_through_absolute_links_in_a_system_dir(tmp_path: Path) -> None:
    # Driver root "/" on the H200 host: /lib holds absolute links into /usr/local/nvidia.
    driver_lib(tmp_path / "usr/local/nvidia/lib64", "libcuda.so")
    link(tmp_path / "lib/libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1")
    link(tmp_path / "lib/libcuda.so", "/usr/local/nvidia/lib64/libcuda.so")
    (cuda,) = user_space.scan_libraries(str(tmp_path), "/", wanted=["libcuda.so"], machine=X86)
    assert cuda.host_path == f"/usr/local/nvidia/lib64/libcuda.so.{VERSION}"
    assert cuda.names == ("libcuda.so", "libcuda.so.1", f"libcuda.so.{VERSION}")


def test_debian_packaged_driver_through_alternatives(tmp_path: Path) -> None:
    current = tmp_path / "usr/lib/x86_64-linux-gnu/nvidia/current"
    elf(current / "libcuda.so.570.1")
    link(current / "libcuda.so.1", "libcuda.so.570.1")
    link(tmp_path / "usr/lib/x86_64-linux-gnu/libcuda.so.1", "nvidia/current/libcuda.so.1")
    (cuda,) = user_space.scan_libraries(str(tmp_path), "/", wanted=["libcuda.so"], machine=X86)
    assert cuda.host_path == "/usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.570.1"
    assert cuda.names == ("libcuda.so.1", "libcuda.so.570.1")


def test_32_bit_and_foreign_libraries_are_not_mounted(tmp_path: Path) -> None:
    elf(tmp_path / "usr/lib/libcuda.so.1", elf_class=1)  # i386 copy
    elf(tmp_path / "usr/lib64/libnvidia-ml.so.1", machine=183)  # aarch64
    (tmp_path / "lib64").mkdir()
    (tmp_path / "lib64/libnvidia-cfg.so.1").write_text("not an ELF file")
    assert user_space.scan_libraries(str(tmp_path), "/", machine=X86) == ()


def test_active_version_wins_over_a_stale_one_left_by_an_upgrade(tmp_path: Path) -> None:
    lib64 = tmp_path / "lib64"
    elf(lib64 / "libcuda.so.570.86.15")
    driver_lib(lib64, "libcuda.so")
    (cuda,) = user_space.scan_libraries(str(tmp_path), "/", wanted=["libcuda.so"], machine=X86)
    assert cuda.host_path == f"/lib64/libcuda.so.{VERSION}"


def test_prefix_match_does_not_confuse_similar_names(tmp_path: Path) -> None:
    driver_lib(tmp_path / "lib64", "libnvidia-pkcs11-openssl3.so", soname_suffix=None)
    libs = user_space.scan_libraries(str(tmp_path), "/", wanted=["libnvidia-pkcs11.so"], machine=X86)
    assert libs == ()


# --------------------------------------------------------------------------- binaries, firmware


def test_binaries_must_be_elf_so_host_wrapper_scripts_are_skipped(tmp_path: Path) -> None:
    (tmp_path / "usr/bin").mkdir(parents=True)
    (tmp_path / "usr/bin/nvidia-smi").write_text('#!/bin/sh\nexec /usr/local/nvidia/bin/nvidia-smi "$@"\n')
    elf(tmp_path / "usr/bin/nvidia-debugdump")
    found = user_space.scan_binaries(str(tmp_path), "/host", machine=X86)
    debugdump = user_space.DriverBinary(host_path="/host/usr/bin/nvidia-debugdump", name="nvidia-debugdump")
    assert found == (debugdump,)


def test_h200_binaries_and_firmware(tmp_path: Path) -> None:
    root = h200_root(tmp_path)
    names = [b.name for b in user_space.scan_binaries(str(root), "/usr/local/nvidia", machine=X86)]
    assert names == ["nvidia-smi", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"]
    assert (
        user_space.find_firmware_dir(str(root), "/usr/local/nvidia", VERSION)
        == f"/usr/local/nvidia/firmware/nvidia/{VERSION}"
    )
    assert user_space.find_firmware_dir(str(root), "/usr/local/nvidia", "570.1") is None


def test_driver_version_comes_from_the_real_libcuda_name(tmp_path: Path) -> None:
    libs = user_space.scan_libraries(str(h200_root(tmp_path)), "/", machine=X86)
    assert user_space.driver_version_from_libraries(libs) == VERSION
    assert user_space.driver_version_from_libraries(()) is None


# --------------------------------------------------------------------------- device nodes


def fake_stat(table: dict[str, tuple[int, int, int]]) -> device_nodes.StatFn:
    """stat() answering from {path: (mode, major, minor)}; FileNotFoundError otherwise."""

    def _stat(path: str) -> os.stat_result:
        if path not in table:
            raise FileNotFoundError(path)
        mode, major, minor = table[path]
        return os.stat_result((mode, 0, 0, 1, 0, 0, 0, 0, 0, 0), {"st_rdev": os.makedev(major, minor)})

    return _stat


def h200_dev(dev: Path) -> device_nodes.StatFn:
    """The H200 host's nodes (reference/h200-host.md) plus two more GPUs to check ordering."""
    chr_ = stat.S_IFCHR
    table = {
        "nvidia0": (chr_ | 0o666, 195, 0),
        "nvidia2": (chr_ | 0o666, 195, 2),
        "nvidia10": (chr_ | 0o666, 195, 10),
        "nvidiactl": (chr_ | 0o666, 195, 255),
        "nvidia-uvm": (chr_ | 0o666, 238, 0),
        "nvidia-uvm-tools": (chr_ | 0o666, 238, 1),
        "nvidia-caps/nvidia-cap1": (chr_ | 0o400, 241, 1),
        "nvidia-caps/nvidia-cap2": (chr_ | 0o444, 241, 2),
        "nvidia-fake": (stat.S_IFREG | 0o644, 0, 0),
        "nvidia3": (stat.S_IFREG | 0o644, 0, 0),  # not a device: ignored
    }
    for name in table:
        (dev / name).parent.mkdir(parents=True, exist_ok=True)
        (dev / name).touch()
    return fake_stat({str(dev / k): v for k, v in table.items()})


def test_device_nodes_by_kind_with_host_numbers(tmp_path: Path) -> None:
    stat_fn = h200_dev(tmp_path)
    control, gpus, caps = device_nodes.scan_device_nodes(str(tmp_path), "/dev", stat_fn)
    assert [(n.path, n.major, n.minor) for n in control] == [
        ("/dev/nvidiactl", 195, 255),
        ("/dev/nvidia-uvm", 238, 0),
        ("/dev/nvidia-uvm-tools", 238, 1),
    ]  # no nvidia-modeset on this host
    assert [(n.path, n.minor) for n in gpus] == [
        ("/dev/nvidia0", 0),
        ("/dev/nvidia2", 2),
        ("/dev/nvidia10", 10),
    ]
    assert [(n.path, n.major, n.minor, n.file_mode) for n in caps] == [
        ("/dev/nvidia-caps/nvidia-cap1", 241, 1, 0o400),
        ("/dev/nvidia-caps/nvidia-cap2", 241, 2, 0o444),
    ]
    assert all(n.host_path == n.path and n.type == "c" for n in (*control, *gpus, *caps))


def test_nodes_seen_under_another_dev_root_keep_the_host_path(tmp_path: Path) -> None:
    stat_fn = h200_dev(tmp_path)
    control, _, _ = device_nodes.scan_device_nodes(str(tmp_path), "/host/dev", stat_fn)
    assert control[0].path == "/dev/nvidiactl"
    assert control[0].host_path == "/host/dev/nvidiactl"


def test_real_stat_reads_a_char_device(tmp_path: Path) -> None:
    # /dev/null is a char device (1, 3) on every Linux host; stat follows the link.
    link(tmp_path / "nvidiactl", "/dev/null")
    (tmp_path / "nvidia-uvm").write_text("")  # a regular file is not a device node
    control, gpus, caps = device_nodes.scan_device_nodes(str(tmp_path), "/dev")
    assert [(n.path, n.type, n.major, n.minor) for n in control] == [("/dev/nvidiactl", "c", 1, 3)]
    assert gpus == () and caps == ()


# --------------------------------------------------------------------------- /proc, MIG caps

PROC_DEVICES = """Character devices:
  1 mem
195 nvidia
195 nvidiactl
238 nvidia-uvm
241 nvidia-caps

Block devices:
  7 loop
240 nvidia-caps
"""


def test_proc_devices_character_section_only() -> None:
    majors = device_nodes.parse_proc_devices(PROC_DEVICES)
    assert majors["nvidia-uvm"] == 238
    assert majors["nvidia-caps"] == 241
    assert majors["nvidia"] == 195
    assert "loop" not in majors


def test_mig_cap_minor_follows_the_driver_table() -> None:
    assert device_nodes.mig_cap_minor(0, 0, None) == 3
    assert device_nodes.mig_cap_minor(0, 0, 0) == 4
    assert device_nodes.mig_cap_minor(0, 0, 7) == 11
    assert device_nodes.mig_cap_minor(0, 1, None) == 12
    assert device_nodes.mig_cap_minor(1, 0, None) == 138
    # The entry after the table (fabric-imex-mgmt) is minor 4323 on the H200 host.
    assert device_nodes.mig_cap_minor(32, 0, None) == 4323


def test_mig_minors_file_is_parsed_and_preferred_over_the_formula() -> None:
    table = device_nodes.parse_mig_minors(
        "config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\ngpu1/gi2/access 900\n"
    )
    assert table == (((0, 0, None), 3), ((0, 0, 0), 4), ((1, 2, None), 900))
    files = dr.simulated_driver_files([1])
    files = replace(files, mig_minors=table)
    gi, ci = files.mig_cap_nodes(1, 2, 0)
    assert (gi.path, gi.major, gi.minor) == ("/dev/nvidia-caps/nvidia-cap900", files.caps_major, 900)
    assert ci.minor == device_nodes.mig_cap_minor(1, 2, 0)


def test_gpu_node_not_present_at_scan_is_synthesized_with_the_fixed_major() -> None:
    files = dr.simulated_driver_files([0])
    node = files.gpu_node(5)
    assert (node.path, node.host_path, node.major, node.minor, node.type) == (
        "/dev/nvidia5",
        "/dev/nvidia5",
        195,
        5,
        "c",
    )


def test_existing_caps_node_is_used_with_its_host_mode(tmp_path: Path) -> None:
    minor = device_nodes.mig_cap_minor(0, 1, None)
    cap = device_nodes.DeviceNodeInfo(f"/dev/nvidia-caps/nvidia-cap{minor}", "/dev/x", 241, minor, 0o400)
    files = dr.DriverFiles(
        driver_root="/",
        control_nodes=(),
        gpu_nodes=(),
        caps_nodes=(cap,),
        libraries=(),
        binaries=(),
        firmware_dir=None,
        driver_version=None,
        caps_major=241,
    )
    gi, ci = files.mig_cap_nodes(0, 1, 0)
    assert gi is cap
    assert ci.file_mode == 0o444 and ci.minor == minor + 1


# --------------------------------------------------------------------------- whole scans


def test_discover_a_real_looking_node(tmp_path: Path) -> None:
    root = h200_root(tmp_path / "driver")
    dev = tmp_path / "dev"
    stat_fn = h200_dev(dev)
    proc = tmp_path / "proc"
    (proc / "driver/nvidia-caps").mkdir(parents=True)
    (proc / "devices").write_text(PROC_DEVICES)
    (proc / "driver/nvidia-caps/mig-minors").write_text("gpu0/gi1/access 12\n")
    files = dr.discover_driver_files(
        str(root),
        str(dev),
        host_driver_root="/usr/local/nvidia",
        proc_root=str(proc),
        stat_fn=stat_fn,
        machine=X86,
    )
    assert not files.simulated
    assert files.driver_root == "/usr/local/nvidia"
    assert files.driver_version == VERSION
    assert files.firmware_dir == f"/usr/local/nvidia/firmware/nvidia/{VERSION}"
    assert files.caps_major == 241
    assert files.mig_minors == (((0, 1, None), 12),)
    assert [n.minor for n in files.gpu_nodes] == [0, 2, 10]
    assert {os.path.basename(b.host_path) for b in files.binaries} == {
        "nvidia-smi",
        "nvidia-cuda-mps-control",
        "nvidia-cuda-mps-server",
    }


def test_simulated_files_have_the_shape_of_real_ones(tmp_path: Path) -> None:
    (tmp_path / "devices").write_text("Character devices:\n511 nvidia-uvm\n")
    files = dr.simulated_driver_files([1, 0], proc_root=str(tmp_path))
    assert files.simulated
    assert [(n.path, n.major, n.minor) for n in files.control_nodes] == [
        ("/dev/nvidiactl", 195, 255),
        ("/dev/nvidia-uvm", 511, 0),
        ("/dev/nvidia-uvm-tools", 511, 1),
    ]
    assert [(n.path, n.major, n.minor, n.file_mode) for n in files.gpu_nodes] == [
        ("/dev/nvidia0", 195, 0, 0o666),
        ("/dev/nvidia1", 195, 1, 0o666),
    ]
    assert files.libraries == () and files.binaries == ()


def test_simulated_without_proc_uses_the_documented_constants(tmp_path: Path) -> None:
    files = dr.simulated_driver_files([0], proc_root=str(tmp_path / "none"))
    assert files.control_nodes[1].major == device_nodes.SIMULATED_UVM_MAJOR
    assert files.caps_major == device_nodes.SIMULATED_CAPS_MAJOR


def test_scan_driver_files_simulated_scans_a_given_root_for_libraries(tmp_path: Path) -> None:
    root = h200_root(tmp_path / "nvidia")
    files = dr.scan_driver_files(root, "/does-not-matter", simulated=True, gpu_minors=[0])
    assert files.simulated
    assert [n.path for n in files.gpu_nodes] == ["/dev/nvidia0"]
    if os.uname().machine == X86:
        assert "libcuda" in by_name(files.libraries)
    assert dr.scan_driver_files(None, "/x", simulated=True).libraries == ()


def test_scan_driver_files_real_uses_the_stat(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    stat_fn = h200_dev(dev)
    files = dr.scan_driver_files(tmp_path / "empty-root", dev, stat_fn=stat_fn, proc_root=tmp_path)
    assert not files.simulated
    assert [n.minor for n in files.gpu_nodes] == [0, 2, 10]
    assert files.libraries == ()


@pytest.mark.parametrize(
    ("machine", "triplet"), [("x86_64", "x86_64-linux-gnu"), ("aarch64", "aarch64-linux-gnu")]
)
def test_library_dirs_follow_the_architecture(machine: str, triplet: str) -> None:
    dirs = user_space.library_dirs(machine)
    assert dirs[0] == "lib64"
    assert f"usr/lib/{triplet}" in dirs
