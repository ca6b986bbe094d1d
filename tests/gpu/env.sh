# env.sh: source this on the GPU machine (after tests/gpu/pack.sh ran here and
# .carry/ was carried): unpacks the libraries and puts the binary on PATH.
# The CUDA libraries (runtime, cuBLAS, NVRTC) come from the machine: the
# toolkit's /usr/local/cuda/lib64, or, for one that is missing there, the
# folder of the pip wheel (nvidia-cublas, ...) that holds it.
mkdir -p /tmp/mnemo-lib && tar -C /tmp/mnemo-lib -xJf .carry/lib.tar.xz --strip-components=1
export LD_LIBRARY_PATH=/tmp/mnemo-lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for mnemo_lib_ in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnvrtc.so.13; do
    [ -e "/usr/local/cuda/lib64/$mnemo_lib_" ] && continue
    ldconfig -p 2>/dev/null | grep -q "$mnemo_lib_" && continue
    mnemo_site_=$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' 2>/dev/null)
    mnemo_dir_=$([ -n "$mnemo_site_" ] && find "$mnemo_site_/nvidia" -name "$mnemo_lib_" -printf '%h\n' 2>/dev/null | head -1)
    if [ -n "$mnemo_dir_" ]; then export LD_LIBRARY_PATH=$mnemo_dir_:$LD_LIBRARY_PATH
    else echo "env.sh: $mnemo_lib_ not found (cuda requests will fail)" >&2; fi
done
unset mnemo_lib_ mnemo_site_ mnemo_dir_
export PATH=$PWD/.carry/bin:$PATH
export MNEMO=$PWD/.carry/bin/mnemo
[ -f "$PWD/.carry/bin/libmnemo_torch.so" ] && export MNEMO_TORCH_LIB=$PWD/.carry/bin/libmnemo_torch.so
