/* param_layout.h: the one description of a memory's fast weights (SPEC.md
 * section 1): for a rule's depth, bias flag and sizes, each parameter's
 * layer, kind, shape, element count and offset in a packed block. The CPU
 * engine, the rule's parameter names and shapes (file I/O), the plan and the
 * three CUDA paths all read it, so "a layer's input is dk if first, its
 * output dv if last" is written here once. Plain C that NVRTC also compiles:
 * kernels/codegen.c puts this file's text in front of the kernel templates,
 * and host code includes it. */
#ifndef MN_PARAM_LAYOUT_H
#define MN_PARAM_LAYOUT_H

/* constexpr in CUDA: the fused kernel uses layer widths as template arguments. */
#if defined(__CUDACC_RTC__)
#define MN_LAYOUT_FN __host__ __device__ constexpr
#elif defined(__CUDACC__)
#define MN_LAYOUT_FN static __host__ __device__ constexpr
#else
#define MN_LAYOUT_FN static inline
#endif

/* 4 L - 2 with glu and bias at MN_MAX_LAYERS = 8 (rule.h). */
#define MN_LAYOUT_MAX_PARAMS 32

/* Layer i's input width (dk for the first) and output width (dv for the
 * last); dh between. Layer i's weight W_{i+1} is [out, in]. */
MN_LAYOUT_FN long long mn_layer_in(int i, long long dk, long long dh) { return i == 0 ? dk : dh; }
MN_LAYOUT_FN long long mn_layer_out(int i, int layers, long long dv, long long dh) { return i == layers - 1 ? dv : dh; }

/* Parameters in order W1, b1, W2, b2, ... (b_i only with bias): the
 * layers' weights, the whole layout of a rule without glu. The CUDA
 * kernels use these four with p below mn_param_count. */
MN_LAYOUT_FN int mn_param_count(int layers, int bias) { return layers * (bias ? 2 : 1); }
MN_LAYOUT_FN int mn_param_layer(int bias, int p) { return bias ? p / 2 : p; }
MN_LAYOUT_FN int mn_param_is_bias(int bias, int p) { return bias && p % 2 == 1; }

/* Elements of parameter p for one memory. */
MN_LAYOUT_FN long long mn_param_numel(int layers, int bias, long long dk, long long dv, long long dh, int p)
{
    int layer = mn_param_layer(bias, p);
    long long out = mn_layer_out(layer, layers, dv, dh);
    return mn_param_is_bias(bias, p) ? out : out * mn_layer_in(layer, dk, dh);
}

/* glu (SPEC v2): the gates' parameters U1, c1, U2, c2, ... of the hidden
 * layers 1 .. L-1 follow all of the above, U_i with W_i's shape and c_i b_i's
 * twin, so a rule without glu keeps its layout and its parameters' indices.
 * Gate parameter p (p >= mn_param_count) belongs to layer (p - count) / per. */
MN_LAYOUT_FN int mn_param_count_glu(int layers, int bias, int glu)
{
    return mn_param_count(layers, bias) + (glu ? mn_param_count(layers - 1, bias) : 0);
}
MN_LAYOUT_FN int mn_param_is_gate(int layers, int bias, int p) { return p >= mn_param_count(layers, bias); }
MN_LAYOUT_FN int mn_param_layer_glu(int layers, int bias, int p)
{
    return mn_param_layer(bias, mn_param_is_gate(layers, bias, p) ? p - mn_param_count(layers, bias) : p);
}
MN_LAYOUT_FN int mn_param_is_bias_glu(int layers, int bias, int p)
{
    return mn_param_is_bias(bias, mn_param_is_gate(layers, bias, p) ? p - mn_param_count(layers, bias) : p);
}
/* Elements of parameter p for one memory, gates included (a gate's as its twin's). */
MN_LAYOUT_FN long long mn_param_numel_glu(int layers, int bias, long long dk, long long dv, long long dh, int p)
{
    return mn_param_numel(layers, bias, dk, dv, dh,
                          mn_param_is_gate(layers, bias, p) ? p - mn_param_count(layers, bias) : p);
}
/* The index of layer i's weight (gate: its U), its bias the next one. */
MN_LAYOUT_FN int mn_param_index(int layers, int bias, int layer, int gate)
{
    return (gate ? mn_param_count(layers, bias) : 0) + layer * (bias ? 2 : 1);
}

typedef struct mn_param_layout {
    int nparams;
    int layer[MN_LAYOUT_MAX_PARAMS];      /* 0-based */
    int is_bias[MN_LAYOUT_MAX_PARAMS];
    int is_gate[MN_LAYOUT_MAX_PARAMS];    /* U_i, c_i of glu */
    long long rows[MN_LAYOUT_MAX_PARAMS]; /* out */
    long long cols[MN_LAYOUT_MAX_PARAMS]; /* in; 1 for a bias */
    long long numel[MN_LAYOUT_MAX_PARAMS];
    long long offset[MN_LAYOUT_MAX_PARAMS]; /* in a packed block of one memory's parameters */
    long long total;
} mn_param_layout;

MN_LAYOUT_FN void mn_param_layout_init(mn_param_layout *lo, int layers, int bias, int glu, long long dk,
                                       long long dv, long long dh)
{
    long long off = 0;
    lo->nparams = mn_param_count_glu(layers, bias, glu);
    for (int p = 0; p < lo->nparams; p++) {
        int layer = mn_param_layer_glu(layers, bias, p);
        lo->layer[p] = layer;
        lo->is_bias[p] = mn_param_is_bias_glu(layers, bias, p);
        lo->is_gate[p] = mn_param_is_gate(layers, bias, p);
        lo->rows[p] = mn_layer_out(layer, layers, dv, dh);
        lo->cols[p] = lo->is_bias[p] ? 1 : mn_layer_in(layer, dk, dh);
        lo->numel[p] = lo->rows[p] * lo->cols[p];
        lo->offset[p] = off;
        off += lo->numel[p];
    }
    lo->total = off;
}

#endif
