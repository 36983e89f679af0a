"""Hosts for multi-host pool tests, made on one machine: each "host" is a network namespace with its own
hostname (a UTS namespace), its own cores (sshd and all it starts are pinned with taskset) and an sshd on its
own address; a bridge in the root namespace joins them, as a switch joins real hosts. mpirun reaches them over
ssh with a key made for the test, exactly as it would reach other machines. The file system is shared, so the
model's path is valid on every host (as it must be on real hosts: each reads its shard from its own path).

Needs root, iproute2 (`ip`), util-linux (`unshare`, `taskset`) and openssh-server; `NetnsHosts.unavailable()`
says why not otherwise (the tests skip with that reason). Everything made is removed by `close()`.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time

SSHD = "/usr/sbin/sshd"


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


class NetnsHosts:
    def __init__(self, n: int = 2):
        tag = os.getpid() % 10000
        self.bridge = f"asbr{tag}"
        self.subnet_id = 64 + os.getpid() % 128
        self.subnet = f"10.77.{self.subnet_id}.0/24"
        self.dir = tempfile.mkdtemp(prefix="asnetns-")
        self.namespaces: list[str] = []
        self.veths: list[str] = []
        self.addresses: list[str] = []
        self.hostnames: list[str] = []
        self.sshd: list[subprocess.Popen] = []
        try:
            self._make(n, tag)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def unavailable() -> str | None:
        if os.geteuid() != 0:
            return "needs root (network namespaces)"
        for tool in ("ip", "unshare", "taskset", "ssh", "ssh-keygen"):
            if shutil.which(tool) is None:
                return f"{tool} not installed (apt-get install iproute2 openssh-client util-linux)"
        if not os.access(SSHD, os.X_OK):
            return "sshd not installed (apt-get install openssh-server)"
        probe = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True)
        if probe.returncode:
            return f"cannot make network namespaces here: {probe.stderr.decode().strip()}"
        return None

    def _make(self, n: int, tag: int) -> None:
        key = os.path.join(self.dir, "key")
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key)
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(self.dir, "hostkey"))
        shutil.copy(key + ".pub", os.path.join(self.dir, "authorized_keys"))
        os.makedirs("/run/sshd", exist_ok=True)          # sshd's privilege-separation directory
        self.ssh = os.path.join(self.dir, "ssh")          # what mpirun runs instead of plain ssh
        with open(self.ssh, "w") as f:
            f.write(f"#!/bin/sh\nexec ssh -i {key} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
                    f"-o BatchMode=yes -o LogLevel=ERROR -o ConnectTimeout=5 "
                    f"-o ServerAliveInterval=3 -o ServerAliveCountMax=3 \"$@\"\n")
        os.chmod(self.ssh, 0o755)
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"10.77.{self.subnet_id}.1/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        cpus = sorted(os.sched_getaffinity(0))
        for i in range(n):
            ns, veth = f"ashost{tag}-{i}", f"asv{tag}-{i}"
            address, hostname = f"10.77.{self.subnet_id}.{10 + i}", f"allspark-host{i}"
            _run("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self.veths.append(veth)
            _run("ip", "link", "set", veth, "master", self.bridge, "up")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", address + "/24", "dev", "eth0")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            conf = os.path.join(self.dir, f"sshd{i}.conf")
            with open(conf, "w") as f:
                f.write(f"Port 22\nListenAddress {address}\nHostKey {self.dir}/hostkey\n"
                        f"AuthorizedKeysFile {self.dir}/authorized_keys\nPermitRootLogin prohibit-password\n"
                        f"StrictModes no\nUsePAM no\nPidFile none\nPasswordAuthentication no\n"
                        f"KbdInteractiveAuthentication no\n")
            host_cpus = ",".join(map(str, cpus[i::n] if len(cpus) >= n else cpus))
            self.sshd.append(subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                 f"hostname {hostname} && exec taskset -c {host_cpus} {SSHD} -D -e -f {conf}"],
                stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.dir, f"sshd{i}.log"), "wb")))
            self.addresses.append(address)
            self.hostnames.append(hostname)
        for address, hostname in zip(self.addresses, self.hostnames):
            deadline = time.monotonic() + 20
            while True:
                out = subprocess.run([self.ssh, address, "hostname"], capture_output=True, text=True, timeout=30)
                if out.returncode == 0 and out.stdout.strip() == hostname:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ssh to {address} failed: {out.stderr.strip()}")
                time.sleep(0.2)

    def mpirun_args(self) -> list[str]:
        """Open MPI 5 arguments: ssh with the test's key, and only the hosts' network for MPI's own traffic."""
        return ["--prtemca", "plm_ssh_agent", self.ssh, "--prtemca", "oob_tcp_if_include", self.subnet,
                "--mca", "btl_tcp_if_include", self.subnet, "--mca", "btl", "tcp,self"]

    def host_of(self, pid: int) -> int | None:
        """Which of the hosts a process runs on (its network namespace), None for the root namespace."""
        try:
            inode = int(re.search(r"\[(\d+)\]", os.readlink(f"/proc/{pid}/ns/net")).group(1))
        except (OSError, AttributeError):
            return None
        for i, ns in enumerate(self.namespaces):
            try:
                if os.stat(f"/run/netns/{ns}").st_ino == inode:
                    return i
            except OSError:
                pass
        return None

    def link(self, i: int, up: bool) -> None:
        """Host i's network cable: down = the host is cut off (its processes keep running)."""
        _run("ip", "link", "set", self.veths[i], "up" if up else "down")

    def close(self) -> None:
        for p in self.sshd:
            p.kill()
        for p in self.sshd:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.namespaces:      # whatever still runs in a namespace (a stranded rank) goes with it
            pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _run("ip", "netns", "del", ns, check=False)
        for veth in self.veths:
            _run("ip", "link", "del", veth, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)
