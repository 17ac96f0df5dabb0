#!/usr/bin/env bash
# The benchmarks on an x86-64 Linux host that reaches no package index (a lent benchmark machine, an
# air-gapped cluster node): pack here what they need for that host's Python, carry it there, unpack it there.
#
#   benchmarks/offline_kit.sh pack [--python-version 3.12] [--tensorflow] [--part-mib 56]   (here, with network)
#   benchmarks/offline_kit.sh unpack [--python python3]                                       (there, in the checkout)
#
# pack writes .kit/ (ignored by git): wheels/ with psctl's dependencies at this environment's versions (the
# versions the figures here were taken with), built for that Python; with --tensorflow also TensorFlow's
# site-packages (tensorflow-cpu and keras with what they need, resolved with numpy, protobuf and grpcio at the
# wheels' versions and then left out, as are TensorFlow's C++ headers and libclang, which only builds use) as
# tf.tar.xz cut into parts of at most --part-mib MiB, for carriers that limit what one transfer holds. Carry
# .kit/ to the same place in the checkout there, the parts in any number of transfers.
# unpack makes .kit/venv (seeing the host's own packages, so what it has already is not installed again),
# installs the wheels into it, puts this checkout on its path (psctl), and joins and unpacks the parts into
# .kit/tf; then:
#
#   PYTHONPATH=$PWD/.kit/tf .kit/venv/bin/python -m benchmarks.vs_tensorflow --threads auto
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=.kit
PY=${PYTHON:-python}  # (pack: the environment whose versions are carried)
action=${1:-}
shift || true
python_version=3.12
python=python3
tensorflow=0
part_mib=56
while [ $# -gt 0 ]; do
    case "$1" in
        --python-version) python_version=$2; shift 2 ;;
        --python) python=$2; shift 2 ;;
        --tensorflow) tensorflow=1; shift ;;
        --part-mib) part_mib=$2; shift 2 ;;
        *) echo "offline_kit: unknown option $1 (see the comment at the top of $0)" >&2; exit 2 ;;
    esac
done

pinned() {  # this environment's version of each named distribution, as name==version
    for name in "$@"; do
        version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" 2>/dev/null) \
            || { echo "offline_kit: $name is not installed here; install psctl's extras first" >&2; exit 2; }
        echo "$name==$version"
    done
}

for_target() {  # pip download/install options for the target's Python on x86-64 Linux (glibc 2.17 to 2.39)
    echo --only-binary=:all: --python-version "$python_version" --implementation cp --platform manylinux2014_x86_64
    for minor in $(seq 17 39); do echo --platform "manylinux_2_${minor}_x86_64"; done
}

case "$action" in
pack)
    rm -rf "$KIT" && mkdir -p "$KIT/wheels"
    # shellcheck disable=SC2046
    "$PY" -m pip download -q $(for_target) -d "$KIT/wheels" \
        $(pinned numpy grpcio protobuf psutil click pyyaml paramiko rich)
    if [ "$tensorflow" = 1 ]; then
        # shellcheck disable=SC2046
        "$PY" -m pip install -q $(for_target) --target "$KIT/tf" $(pinned tensorflow-cpu keras numpy protobuf grpcio)
        # (what the wheels carry already, libclang that only TensorFlow's builds use, the C++ headers)
        (cd "$KIT/tf" && rm -rf bin clang libclang-* numpy numpy.libs numpy-* grpc grpcio-* google/protobuf \
            protobuf-* tensorflow/include)
        tar -C "$KIT/tf" -cf - . | xz -T0 -6 | split -b "${part_mib}M" -d - "$KIT/tf.tar.xz.part"
        rm -rf "$KIT/tf"
    fi
    du -sh "$KIT"/* >&2
    ;;
unpack)
    "$python" -m venv --system-site-packages "$KIT/venv"
    # the pinned versions, from the carried wheels only (the host's own copies of other versions are shadowed)
    "$KIT/venv/bin/pip" install -q --no-index --find-links "$KIT/wheels" "$KIT"/wheels/*.whl
    # psctl from this checkout (a path file: an editable install would need a newer setuptools than a host has)
    "$KIT/venv/bin/python" -c "import os, site; print(os.getcwd(), file=open(os.path.join(site.getsitepackages()[0], \
'psctl-checkout.pth'), 'w'))"
    if compgen -G "$KIT/tf.tar.xz.part*" >/dev/null; then
        rm -rf "$KIT/tf" && mkdir -p "$KIT/tf"
        cat "$KIT"/tf.tar.xz.part* | xz -d | tar -C "$KIT/tf" -xf -
    fi
    "$KIT/venv/bin/python" -c "import numpy, grpc, google.protobuf, psctl; print('offline_kit: ready,', \
numpy.__version__, grpc.__version__, google.protobuf.__version__)"
    ;;
*)
    echo "usage: $0 pack [--python-version 3.12] [--tensorflow] [--part-mib 56] | unpack [--python python3]" >&2
    exit 2
    ;;
esac
