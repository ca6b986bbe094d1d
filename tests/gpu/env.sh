# env.sh: source this on the GPU machine (after tests/gpu/pack.sh ran here and
# .carry/ was carried): unpacks the libraries and puts the binary on PATH.
mkdir -p /tmp/mnemo-lib && tar -C /tmp/mnemo-lib -xJf .carry/lib.tar.xz --strip-components=1
export LD_LIBRARY_PATH=/tmp/mnemo-lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PATH=$PWD/.carry/bin:$PATH
export MNEMO=$PWD/.carry/bin/mnemo
