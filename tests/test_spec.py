"""The cluster spec: every mistake is one exact, line-numbered SpecError; valid specs normalise and plan."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cluster_helpers import REPO_ROOT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psctl.errors import EXIT_USAGE, SpecError
from psctl.launch.hosts import ConfigError, resolve
from psctl.runtime.builtin_programs import BUILTIN_PROGRAMS
from psctl.runtime.optimizer_params import OPTIMIZER_PARAMS
from psctl.runtime.optimizers import make_optimizer
from psctl.spec import (
    MAX_SPEC_BYTES,
    ClusterSpec,
    HostSpec,
    RestartPolicy,
    SupervisionSpec,
    load_spec,
    load_spec_text,
    make_plan,
    parse_duration,
)
from psctl.spec.model import parse_jump
from psctl.spec.plan import PICKED_PORTS, ephemeral_ports

VALID = textwrap.dedent(
    """\
    name: digits
    roles:
      chief: {}
      ps: {replicas: 2}
      worker: {replicas: 3}
      evaluator: {}
    training:
      program: psctl.models.mlp
      data: {name: digits}
      steps: 2000
    """
)


def write(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def spec_error(path: str | Path) -> SpecError:
    with pytest.raises(SpecError) as info:
        make_plan(load_spec(path), check_ports=False)
    assert info.value.exit_code == EXIT_USAGE == 2
    return info.value


# (id, spec text, the exact message). Each file is written to tmp_path/cluster.yaml and loaded from the
# current directory (tmp_path), so messages name "cluster.yaml"; "{dir}" stands for tmp_path.
MISTAKES = [
    (
        "unknown key, did you mean",
        """\
        roles:
          chief: {}
          ps: {}
          wrker: {replicas: 2}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:4: roles.wrker: unknown key; did you mean 'worker'?",
    ),
    (
        "unknown key, no close match",
        """\
        colour: red
        """,
        "cluster.yaml:1: colour: unknown key; expected one of: name, hosts, roles, training, supervision, security, "
        "files, setup, backend, slurm",
    ),
    (
        "unknown nested key",
        """\
        roles:
          chief: {}
          ps: {}
          worker: {replicas: 2, restart: {max_restart: 3}}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:4: roles.worker.restart.max_restart: unknown key; did you mean 'max_restarts'?",
    ),
    (
        "wrong type: text for an integer",
        """\
        name: digits
        roles:
          chief: {}
          ps: {replicas: 1}
          worker:
            replicas: two
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:6: roles.worker.replicas: expected an integer >= 1, got 'two'; write a whole number such as 2",
    ),
    (
        "wrong type: list for a mapping",
        """\
        roles: [chief, ps, worker]
        """,
        "cluster.yaml:1: roles: expected a mapping, got a list; "
        "write key: value pairs, e.g. roles: {chief: {}, ps: {replicas: 1}, worker: {replicas: 2}}",
    ),
    (
        "bool is not an integer",
        """\
        roles:
          chief: {}
          ps: {replicas: true}
          worker: {}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:3: roles.ps.replicas: expected an integer >= 1, got true; write a whole number such as 2",
    ),
    (
        "float is not an integer",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training:
          program: psctl.models.mlp
          data: {name: digits}
          steps: 10.5
        """,
        "cluster.yaml:5: training.steps: expected an integer >= 1, got 10.5; write a whole number such as 1000",
    ),
    (
        "missing role",
        """\
        name: digits
        roles:
          chief: {}
          ps: {replicas: 2}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:2: roles.worker: required role missing; add e.g. worker: {replicas: 1}",
    ),
    (
        "missing training key",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training:
          program: psctl.models.mlp
          data: {name: digits}
        """,
        "cluster.yaml:2: training.steps: required but missing; add steps: 1000",
    ),
    (
        "chief with two replicas",
        """\
        roles:
          chief: {replicas: 2}
          ps: {}
          worker: {}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:2: roles.chief.replicas: the chief has exactly one replica, got 2; remove it or write 1",
    ),
    (
        "port 0",
        """\
        roles:
          chief: {}
          ps: {replicas: 2, port: 0}
          worker: {}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:3: roles.ps.port: expected an integer from 1 to 65535, got 0; use a port number such as 7000",
    ),
    (
        "port 70000 in a list",
        """\
        roles:
          chief: {}
          ps: {}
          worker:
            replicas: 2
            ports:
              - 7100
              - 70000
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:8: roles.worker.ports[1]: expected an integer from 1 to 65535, got 70000; "
        "use a port number such as 7000",
    ),
    (
        "base port runs past 65535",
        """\
        roles:
          chief: {}
          ps: {}
          worker: {replicas: 3, port: 65534}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:4: roles.worker.port: 3 replicas from port 65534 run past 65535; pick a lower base port",
    ),
    (
        "duplicate host names",
        """\
        hosts:
          - {name: a, address: 10.0.0.11}
          - name: a
            address: 10.0.0.12
        roles:
          chief: {host: a, port: 7000}
          ps: {host: a, port: 7001}
          worker: {host: a, port: 7002}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:3: hosts[1].name: host 'a' is defined twice (also hosts[0]); give each host a unique name",
    ),
    (
        "duplicate ports across roles",
        """\
        roles:
          chief: {port: 7000}
          ps: {replicas: 2, port: 7001}
          worker: {replicas: 2, ports: [7100, 7002]}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:4: roles.worker.ports[1]: port 7002 on localhost is used by both ps-1 (roles.ps.port) "
        "and worker-1 (roles.worker.ports[1]); give each instance its own port",
    ),
    (
        "duplicate ports on one remote host",
        """\
        hosts: [{name: a, address: 10.0.0.11}, {name: b, address: 10.0.0.12}]
        roles:
          chief: {host: a, port: 7000}
          ps: {hosts: [b], port: 7000}
          worker:
            hosts: [a]
            port: 7000
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:7: roles.worker.port: port 7000 on host 'a' is used by both chief-0 (roles.chief.port) "
        "and worker-0 (roles.worker.port); give each instance its own port",
    ),
    (
        "more replicas than ports",
        """\
        roles:
          chief: {}
          ps: {}
          worker:
            replicas: 4
            ports: [7100, 7101]
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:6: roles.worker: 4 replicas but 2 ports; list 4 ports or give a base `port:`",
    ),
    (
        "port and ports together",
        """\
        roles:
          chief: {}
          ps: {}
          worker:
            replicas: 2
            port: 7100
            ports: [7100, 7101]
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:7: roles.worker.ports: cannot be combined with roles.worker.port; "
        "keep ports: (one per replica) or port: (a base port: port, port+1, ...)",
    ),
    (
        "host not defined",
        """\
        hosts:
          - {name: alpha, address: 10.0.0.11}
          - {name: beta, address: 10.0.0.12}
        roles:
          chief: {host: alpha, port: 7000}
          ps: {hosts: [alpha, bta], port: 7010}
          worker: {host: beta, port: 7100}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:6: roles.ps.hosts[1]: host 'bta' is not defined under hosts:; did you mean 'beta'?",
    ),
    (
        "a proxy_jump hop that is neither a host of the spec nor user@host:port",
        """\
        hosts:
          - {name: gw, address: 10.0.0.1}
          - {name: a, address: 10.0.0.11, proxy_jump: "gw,bad hop"}
        roles:
          chief: {host: a, port: 7000}
          ps: {host: a, port: 7010}
          worker: {host: a, port: 7100}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:3: hosts[1].proxy_jump: 'bad hop' is not a host of the spec nor [user@]host[:port]; "
        "write e.g. proxy_jump: bastion, or user@10.0.0.1:22 (hops separated by commas)",
    ),
    (
        "a pool for the chief without shared checkpoints",
        """\
        hosts: [{name: a, address: 10.0.0.11}, {name: b, address: 10.0.0.12}]
        roles:
          chief: {hosts: [a, b], port: 7000}
          ps: {host: a, port: 7010}
          worker: {host: b, port: 7100}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:3: roles.chief.hosts: the chief moves to another host of its pool only if the checkpoints "
        "it writes are on storage every host of the pool shares; set training.checkpoint.dir to a folder on "
        "shared storage, or give it one host, e.g. host: a",
    ),
    (
        "a pool for the evaluator without shared checkpoints",
        """\
        hosts: [{name: a, address: 10.0.0.11}, {name: b, address: 10.0.0.12}]
        roles:
          chief: {host: a, port: 7000}
          ps: {host: a, port: 7010}
          worker: {host: b, port: 7100}
          evaluator: {hosts: [b, a], port: 7200}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:6: roles.evaluator.hosts: the evaluator moves to another host of its pool only if the "
        "checkpoints it reads are on storage every host of the pool shares; set training.checkpoint.dir to a "
        "folder on shared storage, or give it one host, e.g. host: b",
    ),
    (
        "pipelined outside asynchronous training",
        """\
        roles: {chief: {}, ps: {}, worker: {replicas: 2}}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10, mode: sync, pipelined: true}
        """,
        "cluster.yaml:2: training.pipelined: only used with training.mode: async, but training.mode is sync; "
        "remove pipelined or set training.mode: async",
    ),
    (
        "several steps per execution outside asynchronous training",
        """\
        roles: {chief: {}, ps: {}, worker: {replicas: 2}}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10, mode: bounded, staleness: 2,
                   steps_per_execution: 4}
        """,
        "cluster.yaml:3: training.steps_per_execution: only used with training.mode: async, but training.mode is "
        "bounded; remove steps_per_execution or set training.mode: async",
    ),
    (
        "no steps per execution",
        """\
        roles: {chief: {}, ps: {}, worker: {replicas: 2}}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10, steps_per_execution: 0}
        """,
        "cluster.yaml:2: training.steps_per_execution: expected an integer >= 1, got 0; "
        "write auto (the default: calls sized by the steps' duration) or a whole number such as 10",
    ),
    (
        "steps per execution neither auto nor a number",
        """\
        roles: {chief: {}, ps: {}, worker: {replicas: 2}}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10, steps_per_execution: fast}
        """,
        "cluster.yaml:2: training.steps_per_execution: expected an integer >= 1, got 'fast'; "
        "write auto (the default: calls sized by the steps' duration) or a whole number such as 10",
    ),
    (
        "a step timeout neither auto nor a duration",
        """\
        roles: {chief: {}, ps: {}, worker: {replicas: 2}}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10, step_timeout: -5s}
        """,
        "cluster.yaml:2: training.step_timeout: expected auto, 0 or a duration such as 10m, got '-5s'; "
        "write auto (a deadline from the steps' durations), 0 (none) or a duration: 90s, 10m",
    ),
    (
        "role names a host but the spec has no hosts",
        """\
        roles:
          chief: {}
          ps: {host: a, port: 7000}
          worker: {}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:3: roles.ps.host: names host 'a' but the spec defines no hosts:; "
        "add a hosts: list that defines 'a', or remove it to run on this machine",
    ),
    (
        "some roles local, some remote",
        """\
        hosts: [{name: a, address: 10.0.0.11}]
        roles:
          chief: {host: a, port: 7000}
          ps: {host: a, port: 7001}
          worker: {replicas: 2}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:5: roles.worker: has no host: but roles.chief runs on hosts; give it host: or hosts: as well "
        "(roles on other machines cannot reach 127.0.0.1; list this machine under hosts: to run it here)",
    ),
    (
        "remote role without a port",
        """\
        hosts: [{name: a, address: 10.0.0.11}]
        roles:
          chief: {host: a, port: 7000}
          ps: {host: a}
          worker: {host: a, port: 7100}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:4: roles.ps: runs on remote hosts but has no port: or ports:; "
        "add port: (a base port: replica i listens on port + i); psctl picks free ports only on this machine",
    ),
    (
        "invalid YAML",
        """\
        roles:
          chief: {}
          ps: {}
          worker: {}
        training:
          program: psctl.models.mlp
          steps: 10: 20
        """,
        "cluster.yaml:7: invalid YAML: mapping values are not allowed here; "
        "check the indentation, colons and quotes on this line",
    ),
    (
        "invalid YAML: unclosed flow mapping",
        """\
        roles:
          chief: {}
          ps: {replicas: 2
          worker: {}
        """,
        "cluster.yaml:4: invalid YAML: expected ',' or '}', but got ':' (while parsing a flow mapping that "
        "starts on line 3); check the indentation, colons and quotes on this line",
    ),
    (
        "empty file",
        "",
        "cluster.yaml:1: the spec is empty; write a mapping with at least roles: and training: (see cluster_examples/)",
    ),
    (
        "only comments",
        """\
        # to do
        """,
        "cluster.yaml:1: the spec is empty; write a mapping with at least roles: and training: (see cluster_examples/)",
    ),
    (
        "top level is a list",
        """\
        - chief
        - ps
        """,
        "cluster.yaml:1: expected a mapping at the top level, got a list; "
        "start the file with keys such as name:, roles: and training:",
    ),
    (
        "duplicate key",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training:
          program: psctl.models.mlp
          data: {name: digits}
          steps: 10
          steps: 20
        """,
        "cluster.yaml:6: training.steps: duplicate key; remove one of the two",
    ),
    (
        "sync-only key in async mode",
        """\
        roles: {chief: {}, ps: {}, worker: {replicas: 2}}
        training:
          program: psctl.models.mlp
          data: {name: digits}
          steps: 10
          replicas_to_aggregate: 2
        """,
        "cluster.yaml:6: training.replicas_to_aggregate: only used with training.mode: sync, but training.mode is "
        "async; remove replicas_to_aggregate or set training.mode: sync",
    ),
    (
        "distinct replicas from more workers than there can be",
        """\
        roles: {chief: {}, ps: {}, worker: {replicas: 2, max_replicas: 3}}
        training:
          program: psctl.models.mlp
          data: {name: digits}
          steps: 10
          mode: sync
          replicas_to_aggregate: 4
          distinct_replicas: true
        """,
        "cluster.yaml:7: training.replicas_to_aggregate: 4 is more than the 3 worker(s) there can be, and "
        "distinct_replicas takes one gradient from each of them per step: no step could complete; use at most 3, "
        "or raise roles.worker.replicas (or max_replicas)",
    ),
    (
        "bounded mode without staleness",
        """\
        roles: {chief: {}, ps: {}, worker: {replicas: 2}}
        training:
          program: psctl.models.mlp
          data: {name: digits}
          steps: 10
          mode: bounded
        """,
        "cluster.yaml:6: training.mode: mode bounded needs training.staleness; "
        "add staleness: (how many steps a worker may run ahead of the slowest), e.g. staleness: 2",
    ),
    (
        "bad duration",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        supervision:
          heartbeat_interval: 5 seconds
        """,
        "cluster.yaml:4: supervision.heartbeat_interval: expected a duration such as 5s, got '5 seconds'; "
        "write a number of seconds or a number with a unit: 500ms, 5s, 2m, 1h",
    ),
    (
        # 1000h passed, and the agents' poll overflowed: the cluster hung in "starting" with training done
        "a duration too long",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        supervision: {heartbeat_interval: 1000h, heartbeat_timeout: 5000h}
        """,
        "cluster.yaml:3: supervision.heartbeat_interval: expected a duration of at most 7 days (604800s), got "
        "'1000h'; write a shorter one",
    ),
    (
        "a step timeout too long",  # (the chief failed on an OverflowError)
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10, step_timeout: 1000000h}
        """,
        "cluster.yaml:2: training.step_timeout: expected a duration of at most 7 days (604800s), got '1000000h'; "
        "write a shorter one",
    ),
    (
        # a key of another section: it was asked "did you mean 'setup'?" (top level), or "'step_timeout'?"
        "a key in the wrong section",
        """\
        steps: 10
        roles: {chief: {}, ps: {}, worker: {}}
        training: {program: psctl.models.mlp, data: {name: digits}}
        """,
        "cluster.yaml:1: steps: unknown key; it belongs elsewhere: training.steps",
    ),
    (
        "a supervision key under training",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10, heartbeat_timeout: 5s}
        """,
        "cluster.yaml:2: training.heartbeat_timeout: unknown key; it belongs elsewhere: supervision.heartbeat_timeout",
    ),
    (
        "a key close to one of its own mapping's",  # (not training.steps: every_steps, as meant)
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10, checkpoint: {steps: 5}}
        """,
        "cluster.yaml:2: training.checkpoint.steps: unknown key; did you mean 'every_steps'?",
    ),
    (
        "a choice in another case",  # (it said: did you mean 'sync'?)
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10, mode: Async}
        """,
        "cluster.yaml:2: training.mode: unknown mode 'Async'; did you mean 'async'? (one of: async, sync, bounded)",
    ),
    (
        "heartbeat timeout not above the interval",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        supervision:
          heartbeat_interval: 2s
          heartbeat_timeout: 2000ms
        """,
        "cluster.yaml:5: supervision.heartbeat_timeout: 2s must be longer than supervision.heartbeat_interval (2s); "
        "allow a few missed heartbeats, e.g. 5 times the interval",
    ),
    (
        "unknown optimizer",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training:
          program: psctl.models.mlp
          data: {name: digits}
          steps: 10
          optimizer:
            name: adamw
        """,
        "cluster.yaml:7: training.optimizer.name: unknown optimizer 'adamw'; "
        "did you mean 'adam'? (one of: sgd, momentum, adagrad, adam)",
    ),
    (
        "a cpu binding that is neither auto nor none",
        """\
        roles: {chief: {}, ps: {}, worker: {cpu_binding: off}}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:1: roles.worker.cpu_binding: unknown cpu_binding false; use one of: auto, none",
    ),
    (
        "another optimizer's parameter",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training:
          program: psctl.models.mlp
          data: {name: digits}
          steps: 10
          optimizer: {name: momentum, beta1: 0.9}
        """,
        "cluster.yaml:6: training.optimizer.beta1: not a parameter of optimizer 'momentum'; "
        "momentum takes momentum, nesterov",
    ),
    (
        "learning rate not positive",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training:
          program: psctl.models.mlp
          data: {name: digits}
          steps: 10
          optimizer: {learning_rate: .nan}
        """,
        "cluster.yaml:6: training.optimizer.learning_rate: expected a number > 0, got nan; "
        "write a positive number such as 0.01",
    ),
    (
        "unknown partitioner kind",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training:
          program: psctl.models.mlp
          data: {name: digits}
          steps: 10
          partitioner:
            kind: fixd
            num_shards: 2
        """,
        "cluster.yaml:7: training.partitioner.kind: unknown partitioner kind 'fixd'; "
        "did you mean 'fixed'? (one of: fixed, min_size, max_size)",
    ),
    (
        "partitioner key of another kind",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training:
          program: psctl.models.mlp
          data: {name: digits}
          steps: 10
          partitioner: {kind: fixed, num_shards: 2, max_shards: 4}
        """,
        "cluster.yaml:6: training.partitioner.max_shards: not used by partitioner kind 'fixed'; fixed takes num_shards",
    ),
    (
        "program path that does not exist",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training:
          program: models/missing.py
          data: {name: digits}
          steps: 10
        """,
        "cluster.yaml:3: training.program: program file 'models/missing.py' does not exist "
        "(looked for {dir}/models/missing.py); "
        "give a path relative to the spec's folder, or a module name such as psctl.models.mlp",
    ),
    (
        "data without name or path",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training:
          program: psctl.models.mlp
          data: {nme: digits}
          steps: 10
        """,
        "cluster.yaml:4: training.data.nme: unknown key; did you mean 'name'?",
    ),
    (
        "reserved environment variable",
        """\
        roles:
          chief: {}
          ps: {}
          worker:
            env:
              TF_CONFIG: "{}"
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:6: roles.worker.env.TF_CONFIG: psctl sets this variable for every role itself; remove it",
    ),
    (
        "boolean key",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training:
          program: psctl.models.mlp
          data: {name: digits}
          steps: 10
          args:
            on: 1
        """,
        "cluster.yaml:7: training.args: keys must be strings, got true; "
        "quote the key (YAML reads yes/no/on/off as booleans and digits as numbers)",
    ),
    (
        "invalid cluster name",
        """\
        name: My_Cluster
        """,
        "cluster.yaml:1: name: 'My_Cluster' is not valid: lowercase letters, digits and dashes, at most 63, "
        "not starting with a dash; write e.g. name: digits",
    ),
    (
        "recursive alias",
        """\
        roles: &r
          chief: {}
          ps: [*r]
        """,
        "cluster.yaml:3: roles.ps[0]: an alias refers to a value that contains it; remove the recursive alias",
    ),
    (
        "unsafe tag",
        """\
        name: !!python/object/apply:os.system [echo]
        """,
        "cluster.yaml:1: name: unsupported YAML tag 'tag:yaml.org,2002:python/object/apply:os.system'; remove the tag",
    ),
    (
        "evaluator away from the chief's checkpoints",
        """\
        hosts: [{name: a, address: 10.0.0.11}, {name: b, address: 10.0.0.12}]
        roles:
          chief: {host: a, port: 7000}
          ps: {hosts: [b], port: 7000}
          worker: {hosts: [a], port: 7001}
          evaluator: {host: b, port: 7002}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:6: roles.evaluator.host: the evaluator must run on the chief's host (a): it reads the "
        "checkpoints the chief writes there; write host: a, or put training.checkpoint.dir on storage both hosts "
        "share",
    ),
    (
        "files: names a missing file",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        files: [vocab.txt]
        """,
        "cluster.yaml:3: files[0]: 'vocab.txt' does not exist (looked for {dir}/vocab.txt); give a path relative "
        "to the spec's folder",
    ),
    (
        "setup: not a list of strings",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        setup: [pip install foo, {run: x}]
        """,
        "cluster.yaml:3: setup[1]: expected a string, got a mapping; write a shell command as a string",
    ),
    (
        "a name YAML reads as a date",
        """\
        name: 2024-01-01
        roles: {chief: {}, ps: {}, worker: {}}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:1: name: expected a string, got the date 2024-01-01; write e.g. name: digits, or quote it: "
        "YAML reads it unquoted as a number or a date",
    ),
    (
        "a host listed twice in a pool",
        """\
        hosts: [{name: a, address: 10.0.0.11}, {name: b, address: 10.0.0.12}]
        roles: {chief: {host: a, port: 7001}, ps: {hosts: [a], port: 7002}, worker: {hosts: [a, b, a], port: 7000}}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:2: roles.worker.hosts[2]: host 'a' is listed twice (also roles.worker.hosts[0]); list each "
        "host of the pool once",
    ),
    (
        "an IPv4 address out of range (it would be looked up as a host name)",
        """\
        hosts: [{name: a, address: 10.0.0.256}]
        roles: {chief: {host: a, port: 7001}, ps: {hosts: [a], port: 7002}, worker: {hosts: [a], port: 7000}}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:1: hosts[0].address: '10.0.0.256' is not an IPv4 address (each part 0-255); write e.g. "
        "address: 10.0.0.11",
    ),
    (
        "a built-in program's arg out of range (its roles would fail as they build the model)",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training: {program: psctl.models.mlp, args: {hidden_units: [64, 0]}, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:2: training.args.hidden_units: expected a positive integer or a list of them, got a list; "
        "write e.g. hidden_units: 64",
    ),
    (
        "a built-in program's arg of the wrong type",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training: {program: psctl.models.wide_embedding, args: {dim: "16"}, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:2: training.args.dim: expected a positive integer, got '16'; write e.g. dim: 64",
    ),
    (
        "a local cluster's data file missing (its roles would fail as they start)",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training: {program: psctl.models.mlp, data: {path: data/train.npz}, steps: 10}
        """,
        "cluster.yaml:2: training.data.path: 'data/train.npz' does not exist (looked for {dir}/data/train.npz); "
        "give a path relative to the spec's folder",
    ),
    (
        "setup: for a Slurm job, which would not run it",
        """\
        backend: slurm
        roles: {chief: {port: 7001}, ps: {port: 7002}, worker: {port: 7003}}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        setup: [module load cuda]
        """,
        "cluster.yaml:4: setup: a Slurm job runs no setup: commands on its nodes; run them before `psctl up` where "
        "the nodes see their result (a shared folder), or remove setup:",
    ),
    (
        "a built-in program misspelt (the chief failed at start)",
        """        roles: {chief: {}, ps: {}, worker: {}}
        training: {program: psctl.models.mlpp, data: {name: digits}, steps: 10}
        """,
        "cluster.yaml:2: training.program: psctl has no program 'psctl.models.mlpp'; did you mean "
        "'psctl.models.mlp'?",
    ),
    (
        "an arg a built-in program does not take (the chief failed at start)",
        """        roles: {chief: {}, ps: {}, worker: {}}
        training:
          program: psctl.models.mlp
          args: {num_classes: 10, hidden_unit: 32}
          data: {name: digits}
        """,
        "cluster.yaml:4: training.args.hidden_unit: psctl.models.mlp takes no arg 'hidden_unit'; did you mean "
        "'hidden_units'?",
    ),
    (
        "a built-in program's data set misspelt (the workers failed at start)",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training: {program: psctl.models.mlp, data: {name: digit}, steps: 10}
        """,
        "cluster.yaml:2: training.data.name: no data set 'digit'; did you mean 'digits'?",
    ),
    (
        "an option its data set does not take",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training:
          program: psctl.models.wide_embedding
          data: {name: synthetic_embedding, vocab_sise: 1000}
          steps: 10
        """,
        "cluster.yaml:4: training.data.vocab_sise: not an option of data set synthetic_embedding; did you mean "
        "'vocab_size'?",
    ),
    (
        "a data option out of its range",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training:
          program: psctl.models.wide_embedding
          data: {name: synthetic_embedding, zipf: 0.5}
          steps: 10
        """,
        "cluster.yaml:4: training.data.zipf: must be 0 (uniform ids) or > 1 (Zipf exponent), got 0.5; write e.g. "
        "zipf: 0.0",
    ),
    (
        "a data file the built-in programs cannot read",
        """\
        roles: {chief: {}, ps: {}, worker: {}}
        training: {program: psctl.models.mlp, data: {path: data/train.parquet}, steps: 10}
        """,
        "cluster.yaml:2: training.data.path: '{dir}/data/train.parquet': the built-in programs read .npz and .csv "
        "files; convert it, or train with a program of your own that reads it",
    ),
]


@pytest.mark.parametrize(("text", "expected"), [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_spec_mistakes_give_one_exact_line(
    text: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path, text)
    monkeypatch.chdir(tmp_path)
    error = spec_error("cluster.yaml")
    assert str(error) == error.format_message() == expected.replace("{dir}", str(tmp_path.resolve()))


def test_unreadable_spec_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    assert str(spec_error(missing)) == f"{missing}: cannot read the spec: No such file or directory; check the path"
    assert str(spec_error(tmp_path)) == f"{tmp_path}: cannot read the spec: Is a directory; check the path"
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"name: \xff\xfe\n")
    assert str(spec_error(binary)) == f"{binary}: cannot read the spec: not UTF-8 text (byte 6)"
    # a device that never ends, or a huge file: refused after 4 MiB, not read whole into memory
    assert str(spec_error("/dev/zero")) == "/dev/zero: not a cluster spec: larger than 4 MiB; give the spec's YAML file"
    huge = tmp_path / "huge.yaml"
    huge.write_bytes(b"# padding\n" * (MAX_SPEC_BYTES // 10 + 1))
    assert str(spec_error(huge)).endswith("not a cluster spec: larger than 4 MiB; give the spec's YAML file")


def test_valid_spec_is_normalised_with_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, VALID, name="whatever.yaml")
    spec = load_spec(path)
    assert isinstance(spec, ClusterSpec)
    assert spec.name == "digits"
    assert spec.path == path.absolute()
    assert spec.hosts == ()
    assert list(spec.roles) == ["chief", "ps", "worker", "evaluator"]
    assert [r.replicas for r in spec.roles.values()] == [1, 2, 3, 1]
    assert spec.roles["worker"].restart == RestartPolicy()
    assert spec.supervision == SupervisionSpec()
    assert spec.training == {
        "program": "psctl.models.mlp",
        "args": {},
        "data": {"name": "digits"},
        "batch_size": 100,
        "optimizer": {"name": "adam", "learning_rate": 0.01, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7},
        "mode": "async",
        "replicas_to_aggregate": None,
        "total_replicas": None,
        "staleness": None,
        "steps": 2000,
        "seed": 0,
        "partitioner": None,
        "placement": "balanced",
        "checkpoint": {"dir": None, "every_steps": 0, "every_seconds": 60.0, "max_to_keep": 5, "keep_every_hours": 0.0},
        "log_every_seconds": 1.0,
        "eval_every_steps": 0,
        "max_evaluations": 0,
        "replica_timeout": None,
        "step_timeout": "auto",
        "min_replicas": None,
        "distinct_replicas": None,
        "pipelined": False,
        "steps_per_execution": "auto",
        "data_shards": 3,
    }
    assert json.loads(json.dumps(spec.training, allow_nan=False)) == spec.training


def test_full_spec_fields_and_sync_defaults(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mine.py").write_text("def build(args, data, seed): ...\n")
    text = """\
        hosts:
          - {name: a, address: 10.0.0.11, user: train, port: 2222, identity_file: ~/.ssh/id,
             host_key_policy: accept-new}
          - {name: b, address: 10.0.0.12}
        roles:
          chief: {host: a, port: 7000}
          ps: {replicas: 2, hosts: [a, b], port: 7010}
          worker:
            replicas: 3
            hosts: [b, a]
            ports: [7100, 7101, 7102]
            restart: {policy: always, max_restarts: 3, backoff_seconds: 500ms, permanent_exit_codes: [2, 3]}
            env: {OMP_NUM_THREADS: 1}
            threads: 1
        training:
          program: models/mine.py
          args: {hidden_units: [100, 50], dropout: 0.5}
          data: {path: data/train.npz, shuffle: true}
          optimizer: {name: momentum, learning_rate: 0.1, nesterov: true}
          mode: sync
          replicas_to_aggregate: 2
          steps: 10
          partitioner: {kind: min_size, max_shards: 2}
          checkpoint: {dir: ~/ckpt, every_steps: 200, every_seconds: 2m}
        supervision: {heartbeat_interval: 500ms, heartbeat_timeout: 3s}
        security: {allowed_paths: ["~"]}
        """
    spec = load_spec(write(tmp_path, text, name="my-cluster.yaml"))
    root = tmp_path.resolve()
    assert spec.name == "my-cluster"  # the file's stem
    assert spec.hosts == (
        HostSpec("a", "10.0.0.11", "train", 2222, "~/.ssh/id", host_key_policy="accept-new"),
        HostSpec("b", "10.0.0.12"),
    )
    worker = spec.roles["worker"]
    assert (worker.hosts, worker.ports, worker.port, worker.threads) == (("b", "a"), (7100, 7101, 7102), None, 1)
    assert worker.env == {"OMP_NUM_THREADS": "1"}
    assert worker.restart == RestartPolicy("always", 3, 0.5, 30.0, (2, 3))
    assert spec.roles["chief"].hosts == ("a",)
    assert spec.supervision == SupervisionSpec(0.5, 3.0, 30.0, 60.0)
    t = spec.training
    assert t["program"] == str(root / "models" / "mine.py")
    assert t["data"] == {"path": str(tmp_path / "data" / "train.npz"), "shuffle": True}
    assert t["args"] == {"hidden_units": [100, 50], "dropout": 0.5}
    assert t["optimizer"] == {"name": "momentum", "learning_rate": 0.1, "momentum": 0.9, "nesterov": 1.0}
    assert (t["replicas_to_aggregate"], t["total_replicas"], t["staleness"]) == (2, 3, None)
    assert t["partitioner"] == {"kind": "min_size", "min_shard_bytes": 262144, "max_shards": 2, "bytes_per_string": 16}
    assert t["checkpoint"]["every_seconds"] == 120.0

    plan = make_plan(spec)  # remote ports are not probed here
    assert plan.names() == ["chief-0", "ps-0", "ps-1", "worker-0", "worker-1", "worker-2"]
    assert [(i.host, i.address, i.port) for i in plan.instances[1:4]] == [
        ("a", "10.0.0.11", 7010),
        ("b", "10.0.0.12", 7011),
        ("b", "10.0.0.12", 7100),
    ]
    assert plan.cluster_addresses() == {
        "chief": ["10.0.0.11:7000"],
        "ps": ["10.0.0.11:7010", "10.0.0.12:7011"],
        "worker": ["10.0.0.12:7100", "10.0.0.11:7101", "10.0.0.12:7102"],
    }


def test_local_plan_picks_distinct_free_ports() -> None:
    plan = make_plan(load_spec_text(VALID, filename="cluster.yaml"))
    assert plan.names() == ["chief-0", "ps-0", "ps-1", "worker-0", "worker-1", "worker-2", "evaluator-0"]
    ports = [i.port for i in plan.instances]
    assert len(set(ports)) == len(ports) and all(1 <= p <= 65535 for p in ports)
    # outside the kernel's range for outgoing connections' source ports: one of those, taken by a connection
    # while its role restarted, kept the role from listening again
    low, high = ephemeral_ports()
    assert all(PICKED_PORTS[0] <= p < PICKED_PORTS[1] and not low <= p <= high for p in ports), (ports, low, high)
    assert {i.host for i in plan.instances} == {"localhost"}
    worker1 = plan.instance("worker-1")
    assert (worker1.role, worker1.index, worker1.address) == ("worker", 1, "127.0.0.1")
    addresses = plan.cluster_addresses()
    assert list(addresses) == ["chief", "ps", "worker", "evaluator"]
    assert addresses["worker"][1] == f"127.0.0.1:{worker1.port}"
    with pytest.raises(SpecError) as info:
        plan.instance("wroker-1")
    assert str(info.value) == (
        "unknown role instance 'wroker-1'; did you mean 'worker-1'? "
        "(valid names: chief-0, ps-0, ps-1, worker-0, worker-1, worker-2, evaluator-0)"
    )
    assert info.value.exit_code == 2


def test_taken_port_is_detected() -> None:
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        text = textwrap.dedent(
            f"""\
            roles:
              chief: {{}}
              ps:
                replicas: 2
                port: {port}
              worker: {{}}
            training: {{program: psctl.models.mlp, data: {{name: digits}}, steps: 10}}
            """
        )
        spec = load_spec_text(text, filename="cluster.yaml")
        with pytest.raises(SpecError) as info:
            make_plan(spec)
        assert str(info.value) == (
            f"cluster.yaml:5: roles.ps.port: port {port} (ps-0) on localhost is already in use; "
            "pick another port or stop what holds it"
        )
        assert info.value.exit_code == 2
        assert make_plan(spec, check_ports=False).instance("ps-1").port == port + 1
        # a Slurm cluster's roles run on the job's nodes, never here: a port taken here is no matter
        slurm = load_spec_text(text.replace("roles:", "backend: slurm\nslurm: {partition: debug}\nroles:").replace(
            "chief: {}", "chief: {port: 7400}").replace("worker: {}", "worker: {port: 7420}"), filename="cluster.yaml")
        assert make_plan(slurm).instance("ps-0").port == port
    finally:
        holder.close()


def test_anchors_and_merge_keys_are_followed() -> None:
    text = textwrap.dedent(
        """\
        roles:
          chief: {}
          ps: &role {replicas: 2, restart: {max_restarts: 3}}
          worker:
            <<: *role
            replicas: 4
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """
    )
    spec = load_spec_text(text)
    assert spec.name == "string"  # from the pseudo file name "<string>"
    assert (spec.roles["worker"].replicas, spec.roles["worker"].restart.max_restarts) == (4, 3)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(0, 0.0), (2, 2.0), (1.5, 1.5), ("500ms", 0.5), ("5s", 5.0), ("2m", 120.0), ("1h", 3600.0), ("1m30s", 90.0),
     ("5", 5.0), ("2.5", 2.5)],  # (quoted seconds are seconds: "write a number of seconds", it said to "10")
)
def test_parse_duration(value: object, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["5 seconds", "-1s", "1d", "", True, None, -1, float("inf"), 10**400, [1]])
def test_parse_duration_refuses(value: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(value)


def test_heartbeat_timeout_default_follows_a_long_interval() -> None:
    spec = load_spec_text(VALID + "supervision: {heartbeat_interval: 10s}\n", filename="cluster.yaml")
    assert spec.supervision.heartbeat_timeout == 50.0


_YAMLISH = st.text(alphabet=st.sampled_from(list("{}[]:,-&*!<>|'\"#\n ab1.~%@?\t\x00é")), max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_YAMLISH, st.builds(lambda i, s: VALID[:i] + s + VALID[i:], st.integers(0, len(VALID)), _YAMLISH)))
def test_any_text_fails_only_as_one_line_spec_error(text: str) -> None:
    try:
        make_plan(load_spec_text(text, filename="c.yaml"), check_ports=False)
    except SpecError as e:
        assert e.format_message().startswith("c.yaml:")
        assert "\n" not in e.format_message()


def test_a_proxy_jump_naming_a_host_of_the_spec_carries_that_host(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, """\
        hosts:
          - {name: gw, address: 10.0.0.1, user: ops, port: 2222}
          - {name: a, address: 10.0.0.11, proxy_jump: "gw, root@10.9.9.9"}
          - {name: b, address: 10.0.0.12, proxy_jump: none}
        roles:
          chief: {host: a, port: 7000}
          ps: {host: b, port: 7010}
          worker: {host: a, port: 7100}
        training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
        """))
    assert spec.host("a").proxy_jump == "gw,root@10.9.9.9"
    assert spec.host("a").jump_hosts == (spec.host("gw"),)  # its user, port, key and jumps go with it
    assert spec.host("b").proxy_jump == "none" and spec.host("gw").proxy_jump is None
    assert spec.host("b").jump_hosts == spec.host("gw").jump_hosts == ()


def test_jump_hosts_that_lead_back_to_themselves_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as err:
        load_spec(write(tmp_path, """\
            hosts:
              - {name: gw1, address: 10.0.0.1, proxy_jump: gw2}
              - {name: gw2, address: 10.0.0.2, proxy_jump: gw1}
            roles:
              chief: {host: gw1, port: 7000}
              ps: {host: gw1, port: 7010}
              worker: {host: gw1, port: 7100}
            training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
            """))
    assert err.value.format_message().endswith(
        "cluster.yaml:3: hosts[1].proxy_jump: jump hosts lead back to where they started: gw1 -> gw2 -> gw1; "
        "remove proxy_jump from one of these hosts"
    )


def test_a_proxy_jump_port_out_of_range_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"hosts\[0\]\.proxy_jump: 'ops@10\.0\.0\.1:70000' is not a host"):
        load_spec(write(tmp_path, """\
            hosts:
              - {name: a, address: 10.0.0.11, proxy_jump: "ops@10.0.0.1:70000"}
            roles:
              chief: {host: a, port: 7000}
              ps: {host: a, port: 7010}
              worker: {host: a, port: 7100}
            training: {program: psctl.models.mlp, data: {name: digits}, steps: 10}
            """))


@pytest.mark.parametrize(("hop", "parsed"), [
    ("gw", (None, "gw", 22)),
    ("ops@10.0.0.1:2222", ("ops", "10.0.0.1", 2222)),
    ("u@[fd00::1]:2022", ("u", "fd00::1", 2022)),
    ("[fd00::1]", (None, "fd00::1", 22)),
])  # fmt: skip
def test_one_jump_hop_grammar_for_specs_and_ssh_configs(hop: str, parsed: tuple[str | None, str, int]) -> None:
    assert parse_jump(hop) == parsed


@pytest.mark.parametrize("hop", ["", "bad hop", "fd00::1", "gw:0", "gw:65536", "@gw", "u@", "a@b@c", "gw:22x"])
def test_what_is_not_a_jump_hop_is_refused_by_both_readers(hop: str) -> None:
    with pytest.raises(ValueError, match=r"is not \[user@\]host\[:port\]"):
        parse_jump(hop)
    with pytest.raises(ConfigError, match=r"proxy jump of host h: .* is not"):  # as resolve() reads a hop
        resolve(HostSpec(name="h", address="10.0.0.9", proxy_jump=f"10.0.0.8,{hop}"), ssh_config=None)


def test_the_chief_and_the_evaluator_get_pools_when_the_checkpoints_are_shared(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, """\
        hosts: [{name: a, address: 10.0.0.11}, {name: b, address: 10.0.0.12}]
        roles:
          chief: {hosts: [a, b], port: 7000}
          ps: {host: a, port: 7010}
          worker: {host: b, port: 7100}
          evaluator: {hosts: [b, a], port: 7200}
        training:
          program: psctl.models.mlp
          data: {name: digits}
          steps: 10
          checkpoint: {dir: shared/ckpt}
        """))
    assert (spec.roles["chief"].hosts, spec.roles["evaluator"].hosts) == (("a", "b"), ("b", "a"))
    assert [(i.name, i.host) for i in make_plan(spec).instances if i.role in ("chief", "evaluator")] == [
        ("chief-0", "a"), ("evaluator-0", "b")]


def test_validating_any_example_spec_leaves_numpy_unimported() -> None:
    # psctl up, psctl validate and the supervisor's start validate the spec: numpy cost each of them ~50 ms
    specs = sorted(str(p) for p in (REPO_ROOT / "cluster_examples").glob("*.yaml"))
    assert len(specs) >= 5
    script = ("import sys\nfrom psctl.spec import load_spec\n"
              "for path in sys.argv[1:]:\n    load_spec(path)\n"
              "print(sorted(m for m in ('numpy', 'grpc', 'psctl.runtime.optimizers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script, *specs], capture_output=True, text=True, timeout=60,
                          cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(("optimizer", "key"), [(o, k) for o, ps in OPTIMIZER_PARAMS.items() for k in ps])
def test_a_spec_refuses_an_optimizer_parameter_itself_wherever_the_runtime_would(optimizer: str, key: str) -> None:
    # the spec's checks come from the runtime's table: a value the runtime refuses, the spec refuses itself,
    # naming the key and how to fix it (not only through its last resort, the runtime's word on the optimizer)
    param = OPTIMIZER_PARAMS[optimizer][key]
    edges = [b for b in (param.above, param.at_least, param.below) if b is not None]
    values: list[object] = [True, False] if param.flag else [v for b in edges for v in (b - 1e-3, b, b + 1e-3)]
    for value in values:
        text = ("name: c\nroles: {chief: {}, ps: {}, worker: {}}\n"
                "training: {program: psctl.models.mlp, data: {name: digits}, steps: 10, "
                f"optimizer: {{name: {optimizer}, {key}: {str(value).lower()}}}}}\n")
        try:
            load_spec_text(text, filename="cluster.yaml")
            spec_ok = True
        except SpecError as exc:
            spec_ok = False
            assert f"training.optimizer.{key}: expected " in str(exc), str(exc)
        try:
            make_optimizer(optimizer, 0.01, {key: float(value)})  # (a flag travels as 0 or 1)
            runtime_ok = True
        except ValueError:
            runtime_ok = False
        assert spec_ok == runtime_ok, (optimizer, key, value)



def test_a_program_of_the_users_own_takes_any_args(tmp_path: Path) -> None:
    """Only psctl's own programs are known before they run; a module or file of the user's checks its args and
    reads its data config itself."""
    (tmp_path / "prog.py").write_text("def build(args, data, seed):\n    raise NotImplementedError\n")
    (tmp_path / "my_models").mkdir()
    (tmp_path / "my_models" / "tower.py").write_text((tmp_path / "prog.py").read_text())
    for program in ("my_models.tower", "prog.py"):
        spec = load_spec(write(tmp_path, f"""\
            roles: {{chief: {{}}, ps: {{}}, worker: {{}}}}
            training: {{program: {program}, args: {{anything: 1}}, data: {{path: x.tfrecord, shards: 4}}, steps: 10}}
            """))
        assert spec.training["args"] == {"anything": 1}
        assert spec.training["data"]["shards"] == 4


def test_a_local_cluster_s_program_module_must_be_where_its_roles_will_import_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every role on this machine: a module a role that imports it could not find is refused before anything
    starts, at the key; found beside the spec (the roles' folder), under each such role's PYTHONPATH, or
    installed, it is not. Nothing of the user's is imported to find it out."""
    monkeypatch.chdir(tmp_path.parent)  # (not the spec's folder: the roles' folder is what counts)
    spec = """\
        roles: {{chief: {{{chief}}}, ps: {{}}, worker: {{{worker}}}}}
        training: {{program: {program}, data: {{name: digits}}, steps: 10}}
        {extra}"""

    def load(program: str, worker: str = "", extra: str = "", chief: str = "") -> object:
        return load_spec(write(tmp_path, spec.format(program=program, worker=worker, extra=extra, chief=chief)))

    error = spec_error(write(tmp_path, spec.format(program="my_modelz.tower", worker="", extra="", chief="")))
    assert str(error) == (
        f"{tmp_path / 'cluster.yaml'}:2: training.program: no module 'my_modelz' for the roles to import: not in "
        f"the spec's folder ({tmp_path}) nor installed for {sys.executable}; give the path of a .py file, put the "
        "module beside the spec, or install its package in this Python")
    boom = "raise SystemExit('imported: the check must only find it')\n"
    (tmp_path / "beside").mkdir()
    (tmp_path / "beside" / "__init__.py").write_text(boom)
    (tmp_path / "lib" / "elsewhere").mkdir(parents=True)
    (tmp_path / "lib" / "elsewhere" / "__init__.py").write_text(boom)
    assert load("beside.model")
    assert load("elsewhere.model", worker="env: {PYTHONPATH: lib}", chief="env: {PYTHONPATH: lib}")
    # a ps imports no program: it needs no PYTHONPATH; the chief does (it passed validate, failed at its start)
    only_workers = write(tmp_path, spec.format(program="elsewhere.model", worker="env: {PYTHONPATH: lib}", extra="",
                                               chief=""))
    assert str(spec_error(only_workers)) == (
        f"{only_workers}:2: training.program: no module 'elsewhere' for chief to import: only the PYTHONPATH of "
        "worker (roles.<role>.env) has it; give chief the same env PYTHONPATH, or put the module beside the spec")
    assert load("json")  # installed (here: the standard library)
    assert "beside" not in sys.modules and "elsewhere" not in sys.modules
    # not where the roles run, or made by the spec's own set-up: not checked here
    assert load("my_modelz.tower", extra="setup: ['pip install my-modelz']")
    assert load_spec(write(tmp_path, """\
        hosts: [{name: a, address: 10.0.0.11}]
        roles: {chief: {host: a, port: 7001}, ps: {hosts: [a], port: 7002}, worker: {hosts: [a], port: 7000}}
        training: {program: my_modelz.tower, data: {name: digits}, steps: 10}
        """))


def test_numbers_are_read_as_yaml_1_2_writes_them_and_text_keys_take_them_as_written(tmp_path: Path) -> None:
    """PyYAML's YAML 1.1 read `time: 1:30:00` as 5400 (base 60: Slurm took 5400 minutes), `0755` as 493 (octal),
    `1.10` as 1.1, and refused `learning_rate: 1e-3` (a string to YAML 1.1)."""
    spec = load_spec_text(textwrap.dedent("""\
        backend: slurm
        slurm: {partition: debug, time: 1:30:00}
        roles:
          chief: {port: 7001}
          ps: {port: 7002}
          worker: {port: 7003, env: {UMASK: 0022, VERSION: 1.10, SHORT: 1:30, HEX: 0x1f, N: 4}}
        training:
          program: psctl.models.mlp
          data: {name: digits}
          steps: 0o20
          optimizer: {name: sgd, learning_rate: 1e-3}
        """), filename="cluster.yaml")
    assert spec.slurm is not None and spec.slurm.time == "1:30:00"
    assert spec.roles["worker"].env == {"UMASK": "0022", "VERSION": "1.10", "SHORT": "1:30", "HEX": "0x1f", "N": "4"}
    assert spec.training["steps"] == 16 and spec.training["optimizer"]["learning_rate"] == 0.001
    # the same on the command line
    over = load_spec_text(VALID, filename="cluster.yaml", overrides=[
        "training.optimizer={name: sgd, learning_rate: 5e-4}", "roles.worker.env.UMASK=0027"])
    assert over.training["optimizer"]["learning_rate"] == 0.0005 and over.roles["worker"].env == {"UMASK": "0027"}


def test_a_built_in_program_s_args_that_its_named_data_contradicts_are_refused_at_the_arg() -> None:
    spec = textwrap.dedent("""\
        roles: {{chief: {{}}, ps: {{}}, worker: {{}}}}
        training: {{program: psctl.models.{program}, data: {data}, steps: 10, args: {args}}}
        """)
    with pytest.raises(SpecError) as info:
        load_spec_text(spec.format(program="mlp", data="{name: digits}", args="{num_features: 10}"),
                       filename="cluster.yaml")
    assert str(info.value) == ("cluster.yaml:2: training.args.num_features: is 10, but the data has 64 features per "
                               "example; remove it (it is read from the data) or give 64")
    with pytest.raises(SpecError, match=r"training.args.vocab_size: is 100, but the data has 20000 ids"):
        load_spec_text(spec.format(program="wide_embedding", data="{name: synthetic_embedding, vocab_size: 20000}",
                                   args="{vocab_size: 100}"), filename="cluster.yaml")
    assert load_spec_text(spec.format(program="mlp", data="{name: digits}", args="{num_classes: 12}"))


def test_data_shards_or_a_batch_beyond_a_named_source_s_training_examples_are_refused() -> None:
    """`data_shards: 100000` on digits (1,438 training examples) was accepted, and the run trained almost
    nothing (accuracy 0.09): shards of no example."""
    spec = textwrap.dedent("""\
        roles: {{chief: {{}}, ps: {{}}, worker: {{replicas: {workers}}}}}
        training: {{program: psctl.models.mlp, data: {data}, steps: 10{shards}}}
        """)
    with pytest.raises(SpecError) as info:
        load_spec_text(spec.format(workers=2, data="{name: digits}", shards=", data_shards: 100000"),
                       filename="cluster.yaml")
    assert str(info.value) == ("cluster.yaml:2: training.data_shards: data_shards 100000 for 1438 training examples "
                               "leaves shards empty; write data_shards: 1438 or fewer (each shard is read whole, in "
                               "order)")
    with pytest.raises(SpecError, match=r"one data shard per worker \(9\) for 8 training examples"):
        load_spec_text(spec.format(workers=9, data="{name: synthetic_classification, num_examples: 10}",
                                   shards=", batch_size: 4"), filename="cluster.yaml")
    assert load_spec_text(spec.format(workers=2, data="{name: digits}", shards=", data_shards: 1438"))
    # a batch above the training examples (1e8 was a MemoryError of 24 GiB in every worker)
    with pytest.raises(SpecError, match=r"^cluster.yaml:2: training.batch_size: 100000000 is more than the data's "
                                        r"1438 training examples; write batch_size: 100 \(at most 1438\)$"):
        load_spec_text(spec.format(workers=2, data="{name: digits}", shards=", batch_size: 100000000"),
                       filename="cluster.yaml")


def test_a_local_cluster_s_checkpoint_folder_must_be_a_folder_and_its_data_path_a_file(tmp_path: Path) -> None:
    """A checkpoint folder under a file passed, and every save of the run failed; a data path that is a folder
    passed, and every role failed reading it."""
    (tmp_path / "a-file").write_text("x", encoding="utf-8")
    (tmp_path / "folder.npz").mkdir()
    spec = """\
        roles: {{chief: {{}}, ps: {{}}, worker: {{}}}}
        training: {{program: psctl.models.mlp, data: {data}, steps: 10, checkpoint: {{dir: {folder}}}}}
        """
    error = spec_error(write(tmp_path, spec.format(data="{name: digits}", folder="a-file/ckpt")))
    assert str(error) == (f"{tmp_path / 'cluster.yaml'}:2: training.checkpoint.dir: 'a-file/ckpt': "
                          f"{tmp_path / 'a-file'} is a file, not a folder; give a folder's path")
    error = spec_error(write(tmp_path, spec.format(data="{path: folder.npz}", folder="ckpt")))
    assert str(error) == (f"{tmp_path / 'cluster.yaml'}:2: training.data.path: 'folder.npz' is a folder "
                          f"({tmp_path / 'folder.npz'}), not a data file; give the path of the .npz or .csv file in it")
    assert load_spec(write(tmp_path, spec.format(data="{name: digits}", folder="new/ckpt")))  # made when saved


@pytest.mark.parametrize(("text", "said"), [
    ("def build(args, data, seed)\n    pass\n", "does not parse: SyntaxError: expected ':' ({file}, line 1)"),
    ("x = 1\n", "defines no build(args, data, seed) ({file})"),
    ("def build(args):\n    pass\n", "build in program file 'prog.py' takes 1 argument(s) ({file}, line 1); the "
     "runtime calls build(args, data, seed)"),
])
def test_a_program_file_that_cannot_be_a_program_is_refused_at_validation(tmp_path: Path, text: str,
                                                                            said: str) -> None:
    """Each passed validation, and every role of the cluster failed at its start (up's exit 3, not a spec's 2)."""
    (tmp_path / "prog.py").write_text(text, encoding="utf-8")
    spec = "roles: {chief: {}, ps: {}, worker: {}}\ntraining: {program: prog.py, data: {name: digits}, steps: 10}\n"
    error = str(spec_error(write(tmp_path, spec)))
    assert error.startswith(f"{tmp_path / 'cluster.yaml'}:2: training.program: ") and \
        said.format(file=tmp_path / "prog.py") in error, error
    for fine in ("from psctl.models.mlp import build  # noqa\n",  # bound otherwise: imported, assigned, in a try
                 "try:\n    from psctl.models.mlp import build\nexcept ImportError:\n    build = None\n",
                 "def build(args, data, seed, extra=None):\n    pass\n", "build, other = 1, 2\n"):
        (tmp_path / "prog.py").write_text(fine, encoding="utf-8")
        assert load_spec(write(tmp_path, spec))


def test_a_checkpoint_folder_in_another_cluster_s_folder_is_refused(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Pointed at cluster r2's checkpoints, cluster sh resumed r2's run, wrote its own checkpoints among them and
    pruned r2's final one; `psctl export r2` then gave sh's model."""
    home = tmp_path / "home"
    monkeypatch.setenv("PSCTL_HOME", str(home))
    (home / "r2" / "checkpoints").mkdir(parents=True)
    (home / "r2" / "state.json").write_text("{}", encoding="utf-8")
    spec = """\
        name: {name}
        roles: {{chief: {{}}, ps: {{}}, worker: {{}}}}
        training: {{program: psctl.models.mlp, data: {{name: digits}}, steps: 10, checkpoint: {{dir: {folder}}}}}
        """
    theirs = home / "r2" / "checkpoints"
    error = spec_error(write(tmp_path, spec.format(name="sh", folder=theirs)))
    assert str(error) == (f"{tmp_path / 'cluster.yaml'}:3: training.checkpoint.dir: {theirs} is in cluster 'r2''s "
                          "folder: its checkpoints are that cluster's, which 'sh' would prune as its own; give 'sh' "
                          "a folder of its own (copy a checkpoint of 'r2' into it to start from there)")
    assert load_spec(write(tmp_path, spec.format(name="r2", folder=theirs)))  # its own
    assert load_spec(write(tmp_path, spec.format(name="sh", folder=home / "shared" / "ckpt")))  # no cluster's


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None,
                    reason="mounting a read-only tmpfs needs root and mount(8)")
def test_a_checkpoint_folder_on_a_read_only_file_system_is_refused_as_such(tmp_path: Path) -> None:
    """A checkpoint folder on a read-only mount was refused as one that "cannot be written by this user", whose fix
    (change its permissions) cannot help there."""
    mounted = tmp_path / "ro"
    mounted.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mounted)], check=True)
    try:
        spec = write(tmp_path, """\
            roles: {chief: {}, ps: {}, worker: {}}
            training: {program: psctl.models.mlp, data: {name: digits}, steps: 10, checkpoint: {dir: ro/ckpt}}
            """)
        assert str(spec_error(spec)) == (
            f"{tmp_path / 'cluster.yaml'}:2: training.checkpoint.dir: 'ro/ckpt': {mounted} is on a read-only file "
            "system; give a folder on a file system mounted read-write, or remount it read-write")
    finally:
        subprocess.run(["umount", str(mounted)], check=True)


@pytest.mark.parametrize("program", sorted(BUILTIN_PROGRAMS))
def test_every_arg_the_spec_lets_through_a_built_in_program_takes(program: str) -> None:
    """The table the spec checks with is the one the programs build with: each arg it lists, they accept."""
    import importlib

    module = importlib.import_module(program)
    embedding = {"name": "synthetic_embedding", "num_examples": 50, "vocab_size": 30}
    data = embedding if program.endswith("wide_embedding") else {"name": "digits"}
    for arg in BUILTIN_PROGRAMS[program]:
        value = {"num_features": 64, "num_classes": 10, "vocab_size": 30}.get(arg, 8)
        assert module.build({arg: value}, data, 0).variables()


# -- --set overrides -----------------------------------------------------------------------------------------
def test_set_overrides_replace_values_create_left_out_mappings_and_the_last_one_wins(tmp_path: Path) -> None:
    path = write(tmp_path, VALID)
    spec = load_spec(path, ["training.steps=500", "roles.worker.replicas=1", "training.checkpoint.every_steps=50",
                            "training.optimizer={name: sgd, learning_rate: 0.5}", "training.steps=700",
                            "roles.ps.ports=[7100, 7101]", "roles.ps.ports[1]=7200"])
    assert spec.training["steps"] == 700
    assert spec.roles["worker"].replicas == 1
    assert spec.training["checkpoint"]["every_steps"] == 50  # the mapping the file left out, its other defaults
    assert (spec.training["optimizer"]["name"], spec.training["optimizer"]["learning_rate"]) == ("sgd", 0.5)
    assert [i.port for i in make_plan(spec, check_ports=False).instances if i.role == "ps"] == [7100, 7200]
    assert spec.overrides == ("training.steps=500", "roles.worker.replicas=1", "training.checkpoint.every_steps=50",
                              "training.optimizer={name: sgd, learning_rate: 0.5}", "training.steps=700",
                              "roles.ps.ports=[7100, 7101]", "roles.ps.ports[1]=7200")
    assert load_spec(path).training["steps"] == 2000 and load_spec(path).overrides == ()  # the file is untouched
    # a list an earlier --set made is named as that --set's
    with pytest.raises(SpecError) as made:
        load_spec(path, ["roles.ps.ports=[7000, 7001]", "roles.ps.ports[2]=7002"])
    assert str(made.value) == ("--set roles.ps.ports[2]=7002: roles.ps.ports is a list of 2 in --set "
                               "roles.ps.ports=[7000, 7001]; set an item that is there, or the whole list (e.g. "
                               "--set roles.ps.ports=[5000, 5001])")


@pytest.mark.parametrize(("override", "message"), [
    # a value the spec refuses: the error names the --set, not a line of the file
    ("training.steps=-5", "--set training.steps=-5: training.steps: expected an integer >= 1, got -5; write a "
                          "whole number such as 1000"),
    ("training.stepz=5", "--set training.stepz=5: training.stepz: unknown key; did you mean 'steps'?"),
    # a misspelt key inside the path: the --set made it, not the file's line above it
    ("roles.worker.restrat.policy=never", "--set roles.worker.restrat.policy=never: roles.worker.restrat: unknown "
                                          "key; did you mean 'restart'?"),
    ("roles.workers.replicas=3", "--set roles.workers.replicas=3: roles.workers: unknown key; did you mean "
                                 "'worker'?"),
    # a fix the file would write as "key: value" is given as the --set to write
    ("name=Bad_Name", "--set name=Bad_Name: name: 'Bad_Name' is not valid: lowercase letters, digits and dashes, at "
                      "most 63, not starting with a dash; write e.g. --set name=digits"),
    ("roles.ps.threads=[1]", "--set roles.ps.threads=[1]: roles.ps.threads: expected an integer >= 1, got a list; "
                             "write e.g. --set roles.ps.threads=1"),
    # what the spec refuses in a value's YAML is said as for the file's, at the --set and the key path
    ("training.optimizer={a: 1, a: 2}", "--set training.optimizer={a: 1, a: 2}: training.optimizer.a: duplicate "
                                        "key; remove one of the two"),
    # an example given as "write key: value" is the --set to write
    ("roles.worker.hosts=3", "--set roles.worker.hosts=3: roles.worker.hosts: expected a list, got 3; write "
                             "--set roles.worker.hosts=[a, b]"),
    # prose that names a key is left as it is ("add --set training=with at least program:, ...")
    ("training=null", "--set training=null: training: required but missing; add training: with at least program:, "
                      "data: and steps:"),
    ("training.optimizer={name: adamw}", "--set training.optimizer={name: adamw}: training.optimizer.name: unknown "
                                         "optimizer 'adamw'; did you mean 'adam'? (one of: sgd, momentum, adagrad, "
                                         "adam)"),
    # a --set that is not one
    ("training.steps", "--set training.steps: no '=' between the key path and the value; write KEY.PATH=VALUE, "
                       "e.g. --set training.steps=2000"),
    ("roles..ps=1", "--set roles..ps=1: 'roles..ps' is not a key path (keys joined by dots, list items as [1]); "
                    "write KEY.PATH=VALUE, e.g. --set training.steps=2000"),
    ("name=[1", "--set name=[1: the value is not valid YAML (expected ',' or ']', but got '<stream end>'); quote a "
                "string that YAML would read otherwise, e.g. --set name='\"my: run\"'"),
    ("roles.ps.replicas.max=3", "--set roles.ps.replicas.max=3: roles.ps.replicas is not a mapping in {spec} (it "
                                "is int); set roles.ps.replicas itself"),
    ("roles.ps.ports[0]=7000", "--set roles.ps.ports[0]=7000: roles.ps.ports is not set in {spec}; set an item "
                               "that is there, or the whole list (e.g. --set roles.ps.ports=[5000, 5001])"),
])
def test_a_bad_set_is_one_line_naming_it(tmp_path: Path, override: str, message: str) -> None:
    path = write(tmp_path, VALID)
    with pytest.raises(SpecError) as info:
        load_spec(path, [override])
    assert str(info.value) == message.replace("{spec}", str(path))
    assert info.value.exit_code == EXIT_USAGE
    # a mistake in the file itself is still placed at its line
    bad = write(tmp_path, VALID.replace("steps: 2000", "steps: -1"), "bad.yaml")
    with pytest.raises(SpecError, match=rf"^{bad}:10: training.steps: expected an integer >= 1"):
        load_spec(bad, ["roles.worker.replicas=1"])


def test_a_pair_broken_by_a_set_is_placed_at_the_set(tmp_path: Path) -> None:
    """The file's timeout was fine until a --set of the interval: the error names that --set, not the file."""
    path = write(tmp_path, VALID + "supervision: {heartbeat_interval: 1s, heartbeat_timeout: 10s}\n")
    with pytest.raises(SpecError) as info:
        load_spec(path, ["supervision.heartbeat_interval=20s"])
    assert str(info.value) == ("--set supervision.heartbeat_interval=20s: supervision.heartbeat_timeout: 10s must be "
                               "longer than supervision.heartbeat_interval (20s); allow a few missed heartbeats, e.g. "
                               "5 times the interval")
    with pytest.raises(SpecError) as info:  # the timeout set there: the error names that --set
        load_spec(path, ["supervision.heartbeat_timeout=1s"])
    assert str(info.value).startswith("--set supervision.heartbeat_timeout=1s: supervision.heartbeat_timeout: 1s")


def test_replicas_set_past_the_file_s_bound_is_placed_at_the_set(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("worker: {replicas: 3", "worker: {max_replicas: 4, replicas: 3"))
    assert "max_replicas: 4, replicas: 3" in path.read_text()
    with pytest.raises(SpecError) as info:
        load_spec(path, ["roles.worker.replicas=9"])
    assert str(info.value) == ("--set roles.worker.replicas=9: roles.worker.max_replicas: 4 is fewer than replicas "
                               "(9); write at least 9, or lower replicas")
