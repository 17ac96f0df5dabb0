"""Spec → plan: every role instance with its host, address and port, in start order.

Host pools are dealt round-robin over a role's replicas. Ports come from ``ports``, else ``port + index``,
else — on this machine only — the kernel picks free ones (bind to port 0). Ports the user chose on this
machine are checked free here, so that ``up`` fails before starting anything rather than half-way;
remote ports are the SSH preflight's job.
"""

from __future__ import annotations

import errno
import random
import socket
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from psctl.errors import SpecError
from psctl.spec.checks import suggestion
from psctl.spec.loader import KeyPath, SourceMap, dotted
from psctl.spec.model import ClusterSpec, HostSpec, RoleSpec

LOCAL_HOST = "localhost"
LOCAL_ADDRESS = "127.0.0.1"


def endpoint(address: str, port: int) -> str:
    """``address:port``, with an IPv6 address in brackets: how gRPC and the roles name where a role listens."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


@dataclass(frozen=True)
class RoleInstance:
    """One process to run: ``name`` is ``f"{role}-{index}"``; ``address:port`` is where it listens."""

    role: str
    index: int
    name: str
    host: str
    address: str
    port: int

    @property
    def endpoint(self) -> str:
        return endpoint(self.address, self.port)


@dataclass(frozen=True)
class Plan:
    """The spec plus its instances, in start order: chief-0, ps-0.., worker-0.., evaluator-0."""

    spec: ClusterSpec
    instances: tuple[RoleInstance, ...]

    def names(self) -> list[str]:
        return [i.name for i in self.instances]

    def instance(self, name: str) -> RoleInstance:
        """The instance called ``name``; an unknown name is a SpecError listing the valid ones."""
        for inst in self.instances:
            if inst.name == name:
                return inst
        names = self.names()
        hint = suggestion(name, names)
        valid = f"valid names: {', '.join(names)}"
        fix = f"{hint} ({valid})" if hint.startswith("did") else valid
        raise SpecError(f"unknown role instance {name!r}; {fix}")

    def hosts_of(self, inst: RoleInstance) -> tuple[str, ...]:
        """Every host ``inst`` may run on: its planned one, then the rest of its role's pool (it restarts on
        another host of the pool when its own is cut off or benched). ``up`` prepares and checks each."""
        return tuple(dict.fromkeys((inst.host, *self.spec.roles[inst.role].hosts)))

    def may_run_on(self, host: str) -> list[RoleInstance]:
        """The instances ``host`` may run: those planned there, and those that may move there."""
        return [inst for inst in self.instances if host in self.hosts_of(inst)]

    def spare_slots(self) -> list[tuple[str, tuple[str, ...]]]:
        """``(name, pool)`` of every replica beyond ``replicas`` up to ``max_replicas`` (``psctl scale``'s)."""
        return [(f"{role}-{i}", spec.hosts) for role, spec in self.spec.roles.items()
                for i in range(spec.replicas, spec.slots)]

    def cluster_addresses(self) -> dict[str, list[str]]:
        """``{"chief": ["127.0.0.1:7000"], "ps": [...], ...}``: the cluster as every role sees it."""
        out: dict[str, list[str]] = {}
        for inst in self.instances:
            out.setdefault(inst.role, []).append(inst.endpoint)
        return out


@dataclass(frozen=True)
class Slot:
    """An instance before free ports are picked; ``port_path`` is the spec key that chose its port."""

    role: str
    index: int
    host: str
    address: str
    port: int | None
    port_path: KeyPath


def slot(role: str, spec: RoleSpec, index: int, by_name: Mapping[str, HostSpec]) -> Slot:
    """Replica ``index`` of ``role``: its pool's host (round-robin) and its chosen port, if any."""
    host = spec.hosts[index % len(spec.hosts)] if spec.hosts else LOCAL_HOST
    address = by_name[host].address if spec.hosts else LOCAL_ADDRESS
    port: int | None
    path: KeyPath
    if spec.ports is not None:
        port, path = spec.ports[index], ("roles", role, "ports", index)
    else:
        port = None if spec.port is None else spec.port + index
        path = ("roles", role, "port")
    return Slot(role, index, host, address, port, path)


def layout(roles: Mapping[str, RoleSpec], hosts: Sequence[HostSpec]) -> list[Slot]:
    """Deal hosts and explicit ports to every replica a role may ever have (up to ``max_replicas``: a scaled
    cluster's ports are checked now), KeyError for a host the spec does not define."""
    by_name = {h.name: h for h in hosts}
    return [slot(role, spec, i, by_name) for role, spec in roles.items() for i in range(spec.slots)]


def port_conflict(slots: Sequence[Slot]) -> tuple[Slot, Slot] | None:
    """The first two slots that would listen on the same port of the same machine, if any."""
    taken: dict[tuple[str, int], Slot] = {}
    for slot in slots:
        if slot.port is None:
            continue
        first = taken.setdefault((slot.address, slot.port), slot)
        if first is not slot:
            return first, slot
    return None


def where(host: str) -> str:
    return LOCAL_HOST if host == LOCAL_HOST else f"host {host!r}"


def make_plan(spec: ClusterSpec, *, check_ports: bool = True) -> Plan:
    """Place every instance; pick free local ports; with ``check_ports`` check chosen local ports are free."""
    source = spec.source
    try:
        slots = layout(spec.roles, spec.hosts)
    except KeyError as e:
        raise source.error(
            ("roles",), f"names host {e.args[0]!r} that the spec does not define", "define it under hosts:"
        ) from None
    clash = port_conflict(slots)
    if clash is not None:
        raise conflict_error(source, *clash)
    for slot in slots:
        if slot.port is None and slot.host != LOCAL_HOST:
            raise source.error(
                ("roles", slot.role),
                "runs on remote hosts but has no port: or ports:",
                "add port: (a base port); psctl picks free ports only on this machine",
                key=True,
            )
    slots = [s for s in slots if s.index < spec.roles[s.role].replicas]  # the rest are for `psctl scale`
    local_chosen = [s for s in slots if s.host == LOCAL_HOST and s.port is not None]
    if check_ports and spec.backend != "slurm":  # (a Slurm cluster's roles run on the job's nodes, not here)
        for slot in local_chosen:
            _check_free(spec, slot)
    free = iter(free_ports(sum(1 for s in slots if s.port is None), avoid={s.port for s in local_chosen}))
    instances = tuple(
        RoleInstance(s.role, s.index, f"{s.role}-{s.index}", s.host, s.address, s.port if s.port else next(free))
        for s in slots
    )
    return Plan(spec, instances)


def conflict_error(source: SourceMap, first: Slot, second: Slot) -> SpecError:
    """Two instances on one port of one machine: name both, at the line of the second one's port."""
    return source.error(
        second.port_path,
        f"port {second.port} on {where(second.host)} is used by both {first.role}-{first.index} "
        f"({dotted(first.port_path)}) and {second.role}-{second.index} ({dotted(second.port_path)})",
        "give each instance its own port",
        key=True,
    )


def _check_free(spec: ClusterSpec, slot: Slot) -> None:
    """Bind the port as the role will (SO_REUSEADDR, so a TIME_WAIT leftover does not count as taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOCAL_ADDRESS, slot.port))
        except OSError as e:
            name = f"{slot.role}-{slot.index}"
            if e.errno in (errno.EACCES, errno.EPERM):
                what, fix = f"port {slot.port} ({name}) on localhost needs root to bind", "pick a port above 1023"
            else:
                what = f"port {slot.port} ({name}) on localhost is already in use"
                fix = "pick another port or stop what holds it"
            raise spec.source.error(slot.port_path, what, fix, key=True) from None


#: Where psctl picks the ports of this machine's roles when the spec names none: below the kernel's ephemeral
#: range (``net.ipv4.ip_local_port_range``, 32768-60999 by default). A port from that range (what binding port 0
#: gives) is also any outgoing connection's source port once free: one taken so while its role was down (a
#: restart) or not yet started kept the role from listening again ("address in use") for as long as that
#: connection lived, a gRPC channel's included.
PICKED_PORTS = (20000, 32768)


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections (Linux's default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(count: int, *, avoid: Collection[int | None]) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1, none in ``avoid`` (all held open until all are chosen): random
    ones of PICKED_PORTS outside the ephemeral range (see there), bound as the role will bind them; where that
    range has too few free ones, any the kernel gives."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    low, high = ephemeral_ports()
    candidates = [p for p in range(*PICKED_PORTS) if not low <= p <= high and p not in avoid]
    try:
        for port in random.sample(candidates, min(len(candidates), count + 64)):
            if len(ports) == count:
                break
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as the role's server will)
            try:
                sock.bind((LOCAL_ADDRESS, port))
            except OSError:
                continue
            ports.append(port)
        for _ in range(count - len(ports) + len(avoid) + 64):
            if len(ports) == count:
                break
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind((LOCAL_ADDRESS, 0))
            port = sock.getsockname()[1]
            if port not in avoid and port not in ports:
                ports.append(port)
    except OSError as e:
        reason = e.strerror or e
        raise SpecError(f"cannot pick free ports on this machine: {reason}; give the roles port: values") from None
    finally:
        for sock in socks:
            sock.close()
    if len(ports) < count:
        raise SpecError("cannot pick enough distinct free ports on this machine; give the roles port: values")
    return ports
