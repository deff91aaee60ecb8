# Sourced by bench/gpu_check.sh and bench/gpu_ab.sh: unpacks .gpu/pack.tgz (bench/gpu_pack.sh)
# in place, once.
if [ -f .gpu/pack.tgz ]; then
  tar xzf .gpu/pack.tgz -C .gpu && rm -f .gpu/pack.tgz || { echo ".gpu/pack.tgz: unpack failed" >&2; exit 1; }
fi
