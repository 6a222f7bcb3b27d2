# Shared by the E4 studies (scaling.sh, context_scaling.sh); sourced, not run.
# mpi_study_setup BYTES: a work folder with corpus.txt of at least BYTES bytes
# (Debian's fortunes when present, repeated), MPI allowed as root, one thread per rank.
mpi_study_setup() {
  cores=$(nproc)  # before OMP_NUM_THREADS=1, which nproc obeys
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  if ls /usr/share/games/fortunes/* >/dev/null 2>&1; then
    find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' -exec cat {} + > "$work/corpus.txt"
  fi
  [ -s "$work/corpus.txt" ] || echo "the quick brown fox jumps over the lazy dog; a stitch in time saves nine." > "$work/corpus.txt"
  while [ "$(stat -c %s "$work/corpus.txt")" -le "$1" ]; do
    cat "$work/corpus.txt" "$work/corpus.txt" > "$work/c2" && mv "$work/c2" "$work/corpus.txt"
  done
}

# mpi_study_memory OUT RANKS: sets peak and sent from `ash grad`'s output: one
# process's peak, or the largest rank's peak and bytes sent.
mpi_study_memory() {
  if [ "$2" = 1 ]; then
    peak=$(sed -n 's/^memory: [A-Za-z]* peak \(.*\), process.*/\1/p' <<<"$1"); sent="0"
  else  # sort -h wants the unit right after the number
    peak=$(grep '^rank ' <<<"$1" | sed 's/.* peak \([0-9.]*\) \([KMG]*i*B\),.*/\1\2/' | sort -h | tail -1)
    sent=$(grep '^rank ' <<<"$1" | sed 's/.*sent \([0-9.]*\) \(.*\)$/\1\2/' | sort -h | tail -1)
  fi
}
