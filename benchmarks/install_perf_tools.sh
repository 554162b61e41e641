#!/usr/bin/env bash
# Install perf_analyzer and genai-perf into their own folder (default build/perf-tools):
#   venv/             genai-perf==0.0.16 in its own virtualenv (it pins its own numpy, pandas...)
#   perf-analyzer/    the perf-analyzer==2.60.0 wheel, unpacked (a self-contained binary)
#   runtime/          on hosts with glibc < 2.38 only: libc6, libstdc++6 and libgcc-s1 from
#                     Debian 13, unpacked with dpkg-deb (the system libc is never touched)
#   bin/perf_analyzer a wrapper that runs the binary through that runtime's dynamic loader
#   bin/genai-perf    genai-perf with bin/ first on PATH, so it finds the wrapper
# Usage: benchmarks/install_perf_tools.sh [folder] [python]; does nothing if already done.
set -euo pipefail

DIR="$(mkdir -p "${1:-build/perf-tools}" && cd "${1:-build/perf-tools}" && pwd)"
PYTHON="${2:-python3}"
PA_VERSION=2.60.0
GENAI_PERF_VERSION=0.0.16
STAMP="$DIR/.installed-$PA_VERSION-$GENAI_PERF_VERSION"
[ -e "$STAMP" ] && exit 0

echo "installing perf_analyzer $PA_VERSION and genai-perf $GENAI_PERF_VERSION into $DIR" >&2
rm -rf "$DIR/venv" "$DIR/perf-analyzer" "$DIR/runtime" "$DIR/bin" "$DIR/downloads"
mkdir -p "$DIR/bin" "$DIR/downloads"

"$PYTHON" -m venv "$DIR/venv"
"$DIR/venv/bin/pip" install --quiet "genai-perf==$GENAI_PERF_VERSION"

# The wheel is tagged manylinux_2_38, so pip on an older glibc refuses to install it: fetch it
# for that platform explicitly and unpack it (a wheel is a zip file).
"$DIR/venv/bin/pip" download --quiet --no-deps --only-binary=:all: \
    --platform manylinux_2_38_x86_64 --dest "$DIR/downloads" "perf-analyzer==$PA_VERSION"
"$DIR/venv/bin/python" -m zipfile -e "$DIR"/downloads/perf_analyzer-"$PA_VERSION"-*.whl "$DIR/perf-analyzer"
BINARY="$DIR/perf-analyzer/perf_analyzer/bin/perf_analyzer"
chmod +x "$BINARY"

glibc="$(getconf GNU_LIBC_VERSION | awk '{print $2}')"
if [ "$(printf '%s\n2.38\n' "$glibc" | sort -V | head -1)" = "2.38" ]; then
    # glibc is new enough: the binary runs as it is.
    printf '#!/bin/sh\nexec "%s" "$@"\n' "$BINARY" > "$DIR/bin/perf_analyzer"
else
    # A private apt configuration: the machine's own Debian sources with the suite changed to
    # trixie (Debian 13), its own lists and cache, no dpkg status; nothing is installed.
    APT="$DIR/downloads/apt"
    mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/sources"
    found=0
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        grep -q -E 'debian(-security)?/?([[:space:]]|$)' "$f" || continue
        # bookworm-updates -> trixie-updates, bookworm-security -> trixie-security, ...
        sed -E 's/\b(bookworm|bullseye|stable)\b/trixie/g' "$f" > "$APT/sources/$(basename "$f")"
        found=1
    done
    [ "$found" = 1 ] || { echo "no Debian apt sources found under /etc/apt" >&2; exit 1; }
    cat > "$APT/apt.conf" <<EOF
Dir::State "$APT";
Dir::State::Lists "$APT/lists";
Dir::State::status "/dev/null";
Dir::Cache "$APT/cache";
Dir::Etc::SourceList "/dev/null";
Dir::Etc::SourceParts "$APT/sources";
Dir::Etc::Preferences "/dev/null";
Dir::Etc::PreferencesParts "/dev/null";
APT::Sandbox::User "root";
EOF
    APT_CONFIG="$APT/apt.conf" apt-get update -qq
    (cd "$DIR/downloads" && APT_CONFIG="$APT/apt.conf" apt-get download -qq libc6 libstdc++6 libgcc-s1)
    for deb in "$DIR"/downloads/*.deb; do
        dpkg-deb -x "$deb" "$DIR/runtime"
    done
    LIBS="$DIR/runtime/usr/lib/x86_64-linux-gnu"
    # The new loader, searching the new libc and libstdc++ first and the system's other
    # libraries (libssl, libz) after them.
    printf '#!/bin/sh\nexec "%s" --library-path "%s:/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu" "%s" "$@"\n' \
        "$LIBS/ld-linux-x86-64.so.2" "$LIBS" "$BINARY" > "$DIR/bin/perf_analyzer"
fi
printf '#!/bin/sh\nPATH="%s:$PATH" exec "%s" "$@"\n' "$DIR/bin" "$DIR/venv/bin/genai-perf" > "$DIR/bin/genai-perf"
chmod +x "$DIR/bin/perf_analyzer" "$DIR/bin/genai-perf"
"$DIR/bin/perf_analyzer" --version >&2
"$DIR/bin/genai-perf" --version >&2
touch "$STAMP"
