-- test_grad_cuda.lua: the backward of a run on the GPU, general path
-- (kernels/grad_kernel.cuh, SPEC.md section 7).
--   Everywhere (a CUDA build, GPU or not): rule:plan's backward line says
--   where a cuda run's backward runs: "general (cuda)" for a covered rule,
--   where a cuda run's backward runs: "general (cuda)" or "fused (cuda)"
--   for every rule (out_norm and glu on the general backward, which the
--   plan says naming them even where the forward is fused; qk_norm around
--   either kernel, the keys normalised by kernels/grad_cuda.c;
--   newton_schulz on either kernel); "cpu, because MNEMO_CUDA_BACKWARD=cpu"
--   only when asked (test_codegen checks that one).
--   On a GPU: for a table of rules across the axes the kernel covers (every
--   loss, activation and clip kind, scopes, custom expressions, depth 1-3,
--   bias, residual, glu, q given or not, step / refresh 0, c, k c / retrieve,
--   reductions, steps longer than a chunk, lengths, skipped steps,
--   non-finite k, v and theta, initial momenta, block sizes; out_norm
--   layernorm and rmsnorm with ln_g, ln_b given; qk_norm l2 and rms on both
--   kernels), a run on cuda
--   and the same run on cpu give the same gradient of every input (k, v, q,
--   theta, eta, alpha) and initial parameter and momentum (and ln_g, ln_b), to fp32
--   tolerance: 1e-4 relative (L2 over the tensor) where the rule is smooth,
--   2e-3 where it has a kink (relu, l1, lp, huber, value/norm clips, where):
--   an element within rounding of a kink may take the other branch on one
--   side, and a branch moves its entry by O(1) times a small factor. A
--   failure names the case, the gradient, the error and the tolerance.
-- Without a GPU the GPU part is SKIP lines (and a cuda run is refused by
-- name). Run from the repository root: mnemo tests/lua/test_grad_cuda.lua
local T = dofile("tests/lua/check.lua")
local m = mnemo or require("mnemo")

---------------------------------------------------------------- the plan's backward line
local has_cuda_build = pcall(function() return m.rule {}:source() end)
local backward_env = os.getenv("MNEMO_CUDA_BACKWARD")
if not has_cuda_build then
  T.skip("grad_cuda/plan", "this build has no CUDA")
elseif (os.getenv("MNEMO_FUSED_CLUSTER") or "") ~= "" then
  -- a forced cluster sends the 2-layer rules' backward to the large path
  T.skip("grad_cuda/plan", "MNEMO_FUSED_CLUSTER is set (test_cluster.lua checks a cluster's backward plan)")
elseif backward_env == "cpu" then
  T.eq("grad_cuda/plan/MNEMO_CUDA_BACKWARD=cpu", m.rule {}:plan { dk = 8 }.backward_why, "MNEMO_CUDA_BACKWARD=cpu")
  T.raises("grad_cuda/plan/MNEMO_CUDA_BACKWARD=cpu/no_backward_source",
           function() return m.rule {}:source { backward = true } end, "the backward of this rule runs on the cpu")
else
  -- which CUDA backward the plan names (kernels/plan.h mn_cuda_plan_backward):
  -- the fused one where the forward is fused (any refresh), else the general one
  local covered = {
    linear = { m.rule {}, "fused" },
    mlp2 = { m.rule { layers = 2, hidden = 8, activation = "gelu", clip = "norm", clip_max = 1 }, "fused" },
    mlp2_refresh0 = { m.rule { layers = 2, hidden = 8, step = 2, refresh = 0 }, "fused" },
    mlp2_refresh4c = { m.rule { layers = 2, hidden = 8, step = 2, refresh = 8 }, "fused" },
    custom = { m.rule { layers = 3, hidden = 8, activation = "z*tanh(softplus(z))", loss = "log(1 + r^2)",
                        clip = "elementwise", clip_expr = "m*tanh(g/m)", constants = { m = 0.01 } }, "general",
               "the forward takes the general path" },
    -- the fused forward runs out_norm, the general backward does (the fused one does not)
    out_norm = { m.rule { out_norm = "layernorm" }, "general", "out_norm layernorm: the general backward runs it" },
    out_norm_mlp2 = { m.rule { layers = 2, hidden = 8, out_norm = "rmsnorm" }, "general", "out_norm rmsnorm" },
    -- glu: the general backward, whatever path the forward takes (general
    -- here, large at a dimension of 256), refresh = step or not
    glu2 = { m.rule { layers = 2, hidden = 8, glu = true }, "general", "glu: the general backward runs it" },
    glu3_bias_refresh0 = { m.rule { layers = 3, hidden = 8, glu = true, bias = true, step = 2, refresh = 0 }, "general",
                           "glu: the general backward runs it" },
    glu2_large_forward = { m.rule { layers = 2, hidden = 256, glu = true, step = 4 }, "general",
                           "glu: the general backward runs it" },
    -- qk_norm: the keys normalised on the device around either kernel
    qk_norm_l2 = { m.rule { qk_norm = "l2" }, "fused" },
    qk_norm_rms_mlp2 = { m.rule { qk_norm = "rms", layers = 2, hidden = 8, activation = "gelu" }, "fused" },
    qk_norm_rms_refresh0 = { m.rule { qk_norm = "rms", layers = 2, hidden = 8, step = 2, refresh = 0 }, "fused" },
    -- both backward kernels run newton_schulz's adjoint (the fused one at the
    -- refresh block's anchor too)
    newton_schulz = { m.rule { precondition = "newton_schulz" }, "fused" },
    newton_schulz_refresh2c = { m.rule { precondition = "newton_schulz", step = 2, refresh = 4 }, "fused" },
    newton_schulz_3layers = { m.rule { precondition = "newton_schulz", layers = 3, hidden = 8 }, "general",
                              "the forward takes the general path" },
  }
  -- the large backward (kernels/grad_large.c) where the forward is large;
  -- newton_schulz and glu on a large forward go to the general one
  covered.large_mlp2 = { m.rule { layers = 2, hidden = 256, step = 4 }, "large", "the forward's large path" }
  covered.large_ns = { m.rule { layers = 2, hidden = 256, step = 4, precondition = "newton_schulz" }, "general",
                       "newton_schulz: the general backward runs it" }
  -- MNEMO_CUDA_BACKWARD=large: forced where it can run the rule, refused by name where not
  local function large_refuses(name)
    return name:find("^out_norm") or name:find("^glu") or name:find("newton_schulz") or name == "large_ns"
  end
  for name, c in pairs(covered) do
    local want = backward_env == "general" and "general" or backward_env == "large" and "large" or c[2]
    if backward_env == "large" and large_refuses(name) then
      T.raises("grad_cuda/plan/" .. name .. "/large_refused", function() return c[1]:plan { dk = 8 } end,
               "MNEMO_CUDA_BACKWARD=large")
      goto next_rule
    end
    local p = c[1]:plan { dk = 8 }
    T.eq("grad_cuda/plan/" .. name .. "/backward", p.backward, want .. " (cuda)")
    -- rule:source{backward = true}: the source of that backward's kernels
    local entry = ({ fused = ") mn_fused_grad_kernel(", general = ") mn_grad_kernel(",
                     large = ") mn_lgrad_update_kernel(" })[want]
    local ok_src, bsrc = pcall(c[1].source, c[1], { dk = 8, backward = true })
    T.ok("grad_cuda/plan/" .. name .. "/backward_source", ok_src and bsrc:find(entry, 1, true) ~= nil and
         bsrc ~= c[1]:source { dk = 8 }, ok_src and ("no '%s' in it"):format(entry) or tostring(bsrc))
    T.ok("grad_cuda/plan/" .. name .. "/printed", tostring(p):find("backward: " .. want .. " (cuda)", 1, true) ~= nil,
         tostring(p))
    if want == "fused" then
      T.ok("grad_cuda/plan/" .. name .. "/fused_shape", p.backward_rows and p.backward_rows % 16 == 0 and
           p.backward_smem_bytes > 0 and p.backward_kernel == "mn_fused_grad_kernel", tostring(p))
    elseif c[3] and backward_env ~= "general" and backward_env ~= "large" then
      T.ok("grad_cuda/plan/" .. name .. "/why", p.backward_why:find(c[3], 1, true) ~= nil, p.backward_why)
    end
    ::next_rule::
  end
  if backward_env ~= "cpu" then
    T.raises("grad_cuda/plan/backward_source_bad_option", function() return m.rule {}:source { backward = true,
             precision = "fp64" } end, "fp64")
  end
  -- every option at once: the GPU's general backward runs them all (no
  -- option sends a backward to the cpu any more), out_norm named as why not fused
  local all = m.rule { layers = 2, hidden = 8, glu = true, out_norm = "rmsnorm", precondition = "newton_schulz",
                       qk_norm = "l2" }
  local why = backward_env ~= "large" and all:plan { dk = 8 }.backward_why or ""
  if backward_env ~= "large" then T.ok("grad_cuda/plan/all_options", all:plan { dk = 8 }.backward == "general (cuda)" and
       (backward_env == "general" or why:find("out_norm rmsnorm", 1, true) ~= nil) and not why:find("cpu", 1, true) and
       not why:find("\n", 1, true), why) end
end

if not m.cuda_available() then
  T.raises("grad_cuda: without a GPU a cuda run is refused by name",
           function() return m.rule {}:run { k = m.randn(4, 3), v = m.randn(4, 3), device = "cuda", grad = true } end,
           "cuda")
  T.skip("grad_cuda/cases", "no usable CUDA device")
  T.done()
end

---------------------------------------------------------------- cuda against cpu
local SMOOTH, KINK, NS_RANK = 1e-4, 2e-3, 1e-3
-- MNEMO_GRAD_PRECISION=tf32|bf16: the cuda runs (forward and backward) in
-- that matrix precision against the cpu's fp32, held to SPEC.md section 3's
-- gradient bounds; a kinked rule on these small widths to finiteness only
local precision = os.getenv("MNEMO_GRAD_PRECISION") or "fp32"
local PREC_TOL = ({ fp32 = 0, tf32 = 1e-2, bf16 = 5e-2 })[precision]
assert(PREC_TOL, "MNEMO_GRAD_PRECISION: expected fp32, tf32 or bf16")

-- One case: rule fields, sizes, and what the run gets. opts: B, H, Tn, dk,
-- dv, dh; q (a query tensor), lengths, momenta (initial S_*), bad = {what,
-- b, h, t[, value]} (a non-finite entry, or value), dloss, dparams (upstream of the finals),
-- block (res:backward{block =}); wscale: the initial weights' scale (0.4
-- randn; a deep case at width 256 takes less, or its activations grow
-- 6x a layer and its trajectory turns chaotic, so that fp32 rounding alone
-- separates the engines); with rule.out_norm, ln (the shape of the
-- ln_g, ln_b given: "dv" (default), "H" or "BH").
local cases = {
  { name = "linear_mse", rule = { theta = 0.1, eta = 0.6 }, tol = SMOOTH },
  { name = "linear_bias_dot_step3", rule = { bias = true, loss = "dot", step = 3, refresh = 3, theta = 0.05, eta = 0.5 },
    tol = SMOOTH },
  { name = "mlp2_gelu_huber_softnorm_tensor_q", rule = { layers = 2, activation = "gelu", bias = true, loss = "huber",
    loss_delta = 0.7, clip = "softnorm", clip_max = 0.5, clip_scope = "tensor", step = 3, refresh = 6 },
    q = true, tol = KINK },
  { name = "mlp2_relu_lp_value_before_mean_sum", rule = { layers = 2, activation = "relu", residual = true,
    loss = "lp", loss_p = 1.5, clip = "value", clip_max = 0.05, step = 2, refresh = 2, retrieve = "before",
    token_reduce = "mean", feature_reduce = "sum" }, dv = 5, tol = KINK },
  { name = "mlp3_tanh_dot_residual_refresh0", rule = { layers = 3, activation = "tanh", bias = true, residual = true,
    loss = "dot", step = 1, refresh = 0, theta = 0.02 }, dv = 5, tol = SMOOTH },
  { name = "mlp2_identity_custom_loss_scale", rule = { layers = 2, activation = "identity", bias = true,
    loss = "w*(y - v)^2 + c3*abs(r)^3", clip = "scale", clip_expr = "exp(-n/(n + m))",
    constants = { w = 0.7, c3 = 0.1, m = 0.25 }, step = 5, refresh = 10 }, tol = KINK },
  { name = "mlp3_custom_act_elementwise_where_loss", rule = { layers = 3, activation = "max(z, a*z)",
    loss = "where(abs(r) <= delta, 0.5*r^2, delta*(abs(r) - 0.5*delta))", clip = "elementwise",
    clip_expr = "m*tanh(g/m)", constants = { a = 0.1, m = 0.25, delta = 0.3 }, step = 1, refresh = 1,
    retrieve = "before" }, tol = KINK },
  { name = "mlp2_custom_act_log_loss_scale_tensor", rule = { layers = 2, activation = "z*tanh(softplus(z))",
    bias = true, loss = "log(1 + r^2)", clip = "scale", clip_expr = "where(n > m, m/n, 1)", clip_scope = "tensor",
    constants = { m = 0.25 }, step = 7, refresh = 0, token_reduce = "mean" }, q = true, tol = KINK },
  { name = "mlp2_silu_logcosh_softvalue", rule = { layers = 2, activation = "silu", loss = "logcosh",
    clip = "softvalue", clip_max = 0.1, step = 4, refresh = 8 }, tol = SMOOTH },
  { name = "linear_long_step_chunked", rule = { bias = true, clip = "norm", clip_max = 0.5, clip_scope = "tensor",
    step = 70, refresh = 140, retrieve = "before", token_reduce = "mean", theta = 0.3 }, Tn = 150, tol = KINK },
  { name = "mlp2_l1_norm_global", rule = { layers = 2, activation = "gelu", loss = "l1", clip = "norm",
    clip_max = 0.2, step = 4, refresh = 0 }, tol = KINK },
  { name = "mlp2_lengths_after", rule = { layers = 2, activation = "silu", bias = true, step = 4, refresh = 8,
    token_reduce = "mean" }, B = 3, Tn = 22, lengths = { 0, 9, 22 }, tol = SMOOTH },
  { name = "linear_lengths_before_q", rule = { step = 3, refresh = 6, retrieve = "before" }, B = 3, Tn = 13,
    lengths = { 13, 4, 7 }, q = true, tol = SMOOTH },
  { name = "mlp2_momenta_given", rule = { layers = 2, activation = "tanh", step = 2, refresh = 4, eta = 0.9 },
    momenta = true, tol = SMOOTH },
  { name = "mlp2_skipped_step_nan_theta", rule = { layers = 2, activation = "silu", step = 3, refresh = 6 },
    bad = { "theta", 1, 2, 5 }, skips = true, tol = SMOOTH },
  { name = "mlp2_nonfinite_k", rule = { layers = 2, activation = "gelu", step = 2, refresh = 4 },
    bad = { "k", 2, 1, 6 }, skips = true, tol = SMOOTH },
  { name = "linear_nonfinite_v_l1", rule = { loss = "l1", step = 3, refresh = 3 }, bad = { "v", 1, 2, 4 },
    tol = KINK },
  { name = "mlp2_block1", rule = { layers = 2, activation = "gelu", step = 2, refresh = 4 }, block = 1, tol = SMOOTH },
  { name = "mlp2_block3_no_dloss_no_dparams", rule = { layers = 2, activation = "silu", step = 2, refresh = 6 },
    block = 3, dloss = false, dparams = false, tol = SMOOTH },
  { name = "mlp2_dk_ne_dv_q", rule = { layers = 2, activation = "silu", bias = true, step = 4, refresh = 4 },
    dk = 6, dv = 3, dh = 5, q = true, tol = SMOOTH },
  -- the fused backward's own concerns (refresh = step): several chunks a step,
  -- widths past one tile, padding, clips by scope, q, retrieve before
  { name = "fused_mlp2_long_steps", rule = { layers = 2, activation = "gelu", bias = true, step = 40, refresh = 40,
    clip = "norm", clip_max = 0.5, theta = 0.02 }, Tn = 150, dk = 20, dv = 18, dh = 40, tol = SMOOTH },
  { name = "fused_mlp2_wide_softnorm_tensor_q", rule = { layers = 2, activation = "silu", step = 8, refresh = 8,
    clip = "softnorm", clip_max = 0.3, clip_scope = "tensor", theta = 0.02 }, Tn = 40, dk = 33, dv = 17, dh = 70,
    q = true, tol = SMOOTH },
  { name = "fused_linear_before_lengths", rule = { bias = true, step = 5, refresh = 5, retrieve = "before",
    token_reduce = "mean" }, B = 3, Tn = 23, dk = 24, dv = 20, lengths = { 23, 9, 0 }, tol = SMOOTH },
  { name = "fused_mlp2_residual_momenta", rule = { layers = 2, activation = "tanh", residual = true, step = 6,
    refresh = 6, eta = 0.9 }, Tn = 30, dk = 16, dv = 16, dh = 32, momenta = true, tol = SMOOTH },
  -- out_norm (the general backward, whichever forward): the norm in every
  -- pass, its second-order adjoint in the step's, ln_g's and ln_b's gradients
  { name = "norm_linear_layernorm", rule = { out_norm = "layernorm", theta = 0.1, eta = 0.6 }, tol = SMOOTH },
  { name = "norm_mlp2_rmsnorm_bias_clip_q", rule = { layers = 2, activation = "gelu", bias = true,
    out_norm = "rmsnorm", step = 3, refresh = 6, clip = "norm", clip_max = 0.5 }, q = true, ln = "H", tol = KINK },
  { name = "norm_mlp2_layernorm_residual_before_lengths", rule = { layers = 2, activation = "silu", residual = true,
    out_norm = "layernorm", step = 2, refresh = 4, retrieve = "before", token_reduce = "mean" }, B = 3, Tn = 13,
    lengths = { 13, 4, 7 }, ln = "BH", tol = SMOOTH },
  { name = "norm_mlp3_rmsnorm_refresh0_no_dloss", rule = { layers = 3, activation = "tanh", bias = true,
    out_norm = "rmsnorm", step = 1, refresh = 0, theta = 0.05 }, dloss = false, dparams = false, tol = SMOOTH },
  { name = "norm_linear_rmsnorm_bias_long_step", rule = { bias = true, out_norm = "rmsnorm", step = 70, refresh = 140,
    theta = 0.3 }, Tn = 150, tol = SMOOTH },
  { name = "norm_mlp2_layernorm_fused_forward_momenta", rule = { layers = 2, activation = "gelu", out_norm = "layernorm",
    step = 4, refresh = 4, theta = 0.05 }, Tn = 24, dk = 16, dv = 16, dh = 32, momenta = true, ln = "H", tol = SMOOTH },
  { name = "norm_mlp2_layernorm_skipped_step", rule = { layers = 2, activation = "silu", out_norm = "layernorm",
    step = 3, refresh = 6 }, bad = { "theta", 1, 2, 5 }, skips = true, tol = SMOOTH },
  -- glu (the general backward): the gates' tangents and adjoints at depth 2
  -- and 3, bias or not, refresh != step, clips, q, lengths, skipped steps,
  -- steps of several chunks, a hidden width of 256 (the forward on the large path)
  { name = "glu2_silu_bias_norm", rule = { layers = 2, glu = true, activation = "silu", bias = true, clip = "norm",
    clip_max = 0.5, step = 3, refresh = 6 }, tol = KINK },
  { name = "glu3_gelu_softnorm_tensor_q_lengths", rule = { layers = 3, glu = true, activation = "gelu",
    clip = "softnorm", clip_max = 0.3, clip_scope = "tensor", step = 2, refresh = 4 }, B = 3, Tn = 13,
    lengths = { 13, 5, 0 }, q = true, tol = SMOOTH },
  { name = "glu2_tanh_residual_before_refresh0", rule = { layers = 2, glu = true, activation = "tanh", residual = true,
    retrieve = "before", step = 2, refresh = 0 }, dv = 5, tol = SMOOTH },
  { name = "glu3_custom_act_loss_elementwise_bias_mean", rule = { layers = 3, glu = true,
    activation = "z*tanh(softplus(z))", bias = true, loss = "log(1 + r^2)", clip = "elementwise", clip_expr = "m*tanh(g/m)", constants = { m = 0.25 },
    step = 4, refresh = 8, token_reduce = "mean" }, q = true, tol = SMOOTH },
  { name = "glu2_long_step_chunked_bias", rule = { layers = 2, glu = true, activation = "silu", bias = true, step = 70,
    refresh = 140, theta = 0.05 }, Tn = 150, tol = SMOOTH },
  { name = "glu2_momenta_refresh_is_step", rule = { layers = 2, glu = true, activation = "silu", step = 3, refresh = 3,
    eta = 0.9 }, momenta = true, dk = 6, dv = 3, dh = 5, tol = SMOOTH },
  { name = "glu2_skipped_step_nan_theta", rule = { layers = 2, glu = true, activation = "silu", bias = true, step = 3,
    refresh = 6 }, bad = { "theta", 1, 2, 5 }, skips = true, tol = SMOOTH },
  { name = "glu3_nonfinite_k_block1", rule = { layers = 3, glu = true, activation = "gelu", step = 2, refresh = 4 },
    bad = { "k", 2, 1, 6 }, skips = true, block = 1, tol = SMOOTH },
  { name = "glu2_hidden256_large_forward", rule = { layers = 2, glu = true, activation = "gelu", bias = true, step = 4,
    refresh = 4, theta = 0.02 }, Tn = 16, dk = 8, dv = 8, dh = 256, tol = SMOOTH },
  -- qk_norm (kernels/grad_cuda.c): the keys and queries normalised on the
  -- device, either kernel on them, their gradients back through the
  -- normalisation on the device; l2 and rms, general and fused, q or not
  { name = "qk_l2_linear_q", rule = { qk_norm = "l2", step = 2, refresh = 4, theta = 0.3 }, q = true, tol = SMOOTH },
  { name = "qk_rms_mlp2_bias_norm_clip", rule = { qk_norm = "rms", layers = 2, activation = "gelu", bias = true,
    clip = "norm", clip_max = 0.5, step = 3, refresh = 6 }, q = true, tol = KINK },
  { name = "qk_l2_mlp3_residual_refresh0", rule = { qk_norm = "l2", layers = 3, activation = "tanh", bias = true,
    residual = true, loss = "dot", step = 1, refresh = 0, theta = 0.02 }, dv = 5, tol = SMOOTH },
  { name = "qk_rms_lengths_before_q", rule = { qk_norm = "rms", step = 3, refresh = 6, retrieve = "before" }, B = 3,
    Tn = 13, lengths = { 13, 4, 7 }, q = true, tol = SMOOTH },
  { name = "qk_l2_mlp2_block1", rule = { qk_norm = "l2", layers = 2, activation = "silu", step = 2, refresh = 4 },
    block = 1, tol = SMOOTH },
  { name = "fused_qk_l2_mlp2_wide_softnorm_q", rule = { qk_norm = "l2", layers = 2, activation = "silu", bias = true,
    step = 8, refresh = 8, clip = "softnorm", clip_max = 0.3, theta = 0.3 }, Tn = 40, dk = 33, dv = 17, dh = 70,
    q = true, tol = SMOOTH },
  { name = "fused_qk_rms_linear_lengths", rule = { qk_norm = "rms", bias = true, step = 5, refresh = 5,
    token_reduce = "mean" }, B = 3, Tn = 23, dk = 24, dv = 20, lengths = { 23, 9, 0 }, tol = SMOOTH },
  -- prec_scale 2: rms-normalised keys (norm sqrt(dk), twice the other
  -- cases') through 40-row steps; tf32's 10-bit products gave 1.4e-2 on an
  -- H200 where fp32 agrees to 1e-4 and bf16 stays inside its 5e-2
  -- (rms-normalised keys are 4.5 long at dk = 20, and 40 tokens a step at
  -- theta 0.02 with 0.4 randn weights made this trajectory chaotic: every
  -- backward, the general one too, missed 1e-4 by up to 1.5x in fp32 and
  -- tf32 by 10x; smaller weights and a norm clip keep it well-conditioned)
  { name = "fused_qk_rms_mlp2_long_steps_q", rule = { qk_norm = "rms", layers = 2, activation = "gelu", step = 40,
    refresh = 40, theta = 0.02, clip = "norm", clip_max = 1 }, Tn = 150, dk = 20, dv = 18, dh = 40, q = true,
    wscale = 0.2, tol = SMOOTH },
  { name = "fused_qk_l2_mlp2_nonfinite_k", rule = { qk_norm = "l2", layers = 2, activation = "gelu", step = 4,
    refresh = 4 }, bad = { "k", 2, 1, 6 }, skips = true, tol = SMOOTH },
  -- precondition = newton_schulz (its adjoint in double; the fused backward
  -- where refresh = step, else the general one). Steps of at least as many
  -- rows as a matrix's smaller side keep G of full rank; NS_RANK: a step of
  -- fewer rows leaves G rank-deficient, its null directions rounding noise
  -- that the iteration multiplies by up to 3.4445^ns_steps, differently on
  -- each engine
  { name = "ns_linear_refresh_step", rule = { precondition = "newton_schulz", ns_steps = 3, step = 6, refresh = 6 },
    Tn = 24, tol = SMOOTH },
  { name = "ns_fused_mlp2_bias_norm_q", rule = { precondition = "newton_schulz", layers = 2, activation = "gelu",
    bias = true, clip = "norm", clip_max = 0.5, step = 8, refresh = 8, theta = 0.05 }, Tn = 32, dk = 6, dv = 5,
    dh = 10, q = true, tol = KINK },
  { name = "ns_fused_mlp2_lengths_elementwise_before", rule = { precondition = "newton_schulz", ns_steps = 2,
    layers = 2, activation = "tanh", clip = "elementwise", clip_expr = "m*tanh(g/m)", constants = { m = 0.25 },
    step = 6, refresh = 6, retrieve = "before", token_reduce = "mean" }, B = 3, Tn = 24, lengths = { 24, 0, 12 },
    tol = SMOOTH },
  { name = "ns_mlp2_bias_norm_q_refresh2c", rule = { precondition = "newton_schulz", layers = 2, activation = "gelu",
    bias = true, clip = "norm", clip_max = 0.5, step = 8, refresh = 16, theta = 0.05 }, Tn = 32, dk = 4, dv = 3,
    dh = 6, q = true, tol = KINK },
  { name = "ns_mlp3_tanh_lengths_refresh0_before", rule = { precondition = "newton_schulz", ns_steps = 2, layers = 3,
    activation = "tanh", step = 6, refresh = 0, retrieve = "before", token_reduce = "mean" }, B = 3, Tn = 24,
    lengths = { 24, 0, 12 }, tol = SMOOTH },
  { name = "ns_mlp2_softnorm_tensor_momenta_block", rule = { precondition = "newton_schulz", ns_steps = 4,
    layers = 2, activation = "silu", bias = true, clip = "softnorm", clip_max = 0.3, clip_scope = "tensor", step = 7,
    refresh = 14, eta = 0.8 }, Tn = 28, dk = 5, dv = 4, dh = 7, momenta = true, block = 2, tol = SMOOTH },
  { name = "ns_mlp2_skipped_step_nan_theta", rule = { precondition = "newton_schulz", layers = 2, activation = "silu",
    step = 6, refresh = 12 }, Tn = 24, bad = { "theta", 1, 2, 5 }, skips = true, tol = SMOOTH },
  { name = "ns_linear_rank_deficient_step2", rule = { precondition = "newton_schulz", ns_steps = 5, step = 2,
    refresh = 4 }, tol = NS_RANK },
  -- refresh != step on the fused backward: the anchor in the slots, its
  -- adjoint joined at a refresh block's first step; retrievals at W^(s)
  -- and W^(s+1) apart from it
  { name = "fused_mlp2_refresh4c_long_steps_after", rule = { layers = 2, activation = "gelu", bias = true, step = 40,
    refresh = 160, clip = "norm", clip_max = 0.5, theta = 0.02 }, Tn = 150, dk = 20, dv = 18, dh = 40, block = 3,
    tol = SMOOTH },
  { name = "fused_mlp2_refresh2c_before_q_lengths", rule = { layers = 2, activation = "silu", step = 4, refresh = 8,
    retrieve = "before", clip = "softnorm", clip_max = 0.3, clip_scope = "tensor", theta = 0.02 }, B = 3, Tn = 37,
    dk = 33, dv = 17, dh = 70, q = true, lengths = { 37, 9, 0 }, block = 2, tol = SMOOTH },
  { name = "fused_linear_refresh0_mean", rule = { bias = true, step = 5, refresh = 0, token_reduce = "mean" }, Tn = 33,
    dk = 24, dv = 20, tol = SMOOTH },
  { name = "fused_mlp2_refresh0_nan_theta_momenta", rule = { layers = 2, activation = "tanh", residual = true,
    step = 3, refresh = 0, eta = 0.9 }, Tn = 30, dk = 16, dv = 16, dh = 32, momenta = true,
    bad = { "theta", 1, 2, 5 }, skips = true, tol = SMOOTH },
  -- (P1-c16's norm clip too: without it this case's weights, 0.4 randn at
  -- widths 64 and 256, diverge, |G| reaching 1e10, and the fp32 rounding of
  -- the two engines' forwards already differs by 1e-4 before any backward)
  { name = "fused_mlp2_p1c16_shape", rule = { layers = 2, activation = "gelu", bias = true, step = 16, refresh = 64,
    theta = 0.02, clip = "norm", clip_max = 1 }, B = 1, H = 2, Tn = 200, dk = 64, dv = 64, dh = 256, tol = SMOOTH },
  -- a dimension of 256: the forward's large path, and the large backward
  -- (kernels/grad_large.c): cuBLAS products, every memory in step
  { name = "large_mlp2_gelu_bias_norm_q", rule = { layers = 2, activation = "gelu", bias = true, clip = "norm",
    clip_max = 1, step = 4, refresh = 4, theta = 0.05 }, Tn = 18, dk = 24, dv = 20, dh = 256, q = true, block = 2,
    tol = SMOOTH },
  { name = "large_linear_residual_before_refresh0_momenta", rule = { bias = true, residual = true, step = 3,
    refresh = 0, retrieve = "before", token_reduce = "mean", theta = 0.02 }, Tn = 14, dk = 256, dv = 256,
    momenta = true, tol = SMOOTH },
  { name = "large_mlp3_silu_custom_loss_softnorm_tensor_anchor", rule = { layers = 3, activation = "silu",
    loss = "log(1 + r^2)", clip = "softnorm", clip_max = 0.5, clip_scope = "tensor", step = 2, refresh = 6,
    feature_reduce = "sum", theta = 0.02 }, Tn = 15, dk = 16, dv = 12, dh = 256, block = 2, wscale = 0.1,
    tol = SMOOTH },
  -- a finite theta so large (3.4e38, with the features summed) that dL/dy
  -- overflows and one memory's step is skipped: the inputs are finite, so
  -- the large backward runs it (dG = 0 for that memory and step only)
  { name = "large_mlp2_skipped_step_huge_theta", rule = { layers = 2, activation = "silu", bias = true, step = 3,
    refresh = 3, feature_reduce = "sum", theta = 0.02 }, Tn = 14, dk = 16, dv = 16, dh = 256, wscale = 0.1,
    bad = { "theta", 1, 2, 5, 3.4e38 }, skips = true, tol = SMOOTH },
  -- many blocks of 2 steps: the large backward captures one block's
  -- reverse into a CUDA graph and replays it for the others (the device
  -- holds the block's first step); the last block, with a short step,
  -- and the first full one run directly
  { name = "large_mlp2_graph_blocks_q", rule = { layers = 2, activation = "gelu", bias = true, step = 2,
    theta = 0.02 }, Tn = 41, dk = 16, dv = 12, dh = 256, q = true, block = 2, wscale = 0.1, tol = SMOOTH },
  -- refresh blocks of 3 steps walked in blocks of 2: the captured block
  -- (first step 12) is replayed only where a block starts at the same place
  -- in its refresh block (steps 6 and 0); the others run directly
  { name = "large_mlp2_graph_refresh_phases_momenta", rule = { layers = 2, activation = "silu", bias = true,
    step = 2, refresh = 6, clip = "norm", clip_max = 0.5, eta = 0.8, theta = 0.02 }, Tn = 32, dk = 16, dv = 16,
    dh = 256, momenta = true, block = 2, wscale = 0.1, tol = SMOOTH },
  { name = "large_mlp2_custom_act_elementwise_long_step", rule = { layers = 2, activation = "z*tanh(softplus(z))",
    clip = "elementwise", clip_expr = "m*tanh(g/m)", constants = { m = 0.05 }, step = 70, refresh = 70,
    theta = 0.01 }, B = 1, H = 3, Tn = 150, dk = 20, dv = 20, dh = 300, tol = SMOOTH },
}

local function put_bad(t, b, h, tok, value) t[{ b, h, tok }] = value end

-- grads of one side, the bad token's own entries zeroed (SPEC.md section 7:
-- unspecified) so that the comparison reads only what must agree
local function masked(g, bad)
  if not bad then return g end
  local _, b, h, tok = table.unpack(bad)
  for _, key in ipairs { "k", "v", "q", "theta" } do
    if g[key] then
      local c = g[key]:cpu():clone()
      c[{ b, h, tok }] = 0
      g[key] = c
    end
  end
  return g
end

-- MNEMO_TEST_SHARD=k/n: only the cases whose index is k mod n (a GPU
-- machine runs n processes at once; each case's first backward compiles its
-- kernels with NVRTC, seconds a case); MNEMO_TEST_ONLY=TEXT: only the cases
-- whose name contains TEXT
local shard_k, shard_n = (os.getenv("MNEMO_TEST_SHARD") or ""):match("^(%d+)/(%d+)$")
shard_k, shard_n = tonumber(shard_k), tonumber(shard_n)
local only = os.getenv("MNEMO_TEST_ONLY")
for ci, c in ipairs(cases) do
  if shard_n and (ci - 1) % shard_n ~= shard_k then goto next_case end
  if only and not c.name:find(only, 1, true) then goto next_case end
  -- MNEMO_CUDA_BACKWARD=large refuses these options (the plan test above)
  if backward_env == "large" and (c.rule.glu or c.rule.out_norm or c.rule.precondition) then
    T.skip("grad_cuda/" .. c.name, "MNEMO_CUDA_BACKWARD=large does not run its options")
    goto next_case
  end
  m.seed(100 + ci)
  local B, H, Tn = c.B or 2, c.H or 2, c.Tn or 12
  local dk, dv, dh = c.dk or 4, c.dv or (c.rule.residual and 4) or 4, c.dh or 6
  if c.rule.residual then dk = dv end
  local ropts = { hidden = dh }
  for key, val in pairs(c.rule) do ropts[key] = val end
  ropts.theta, ropts.eta = nil, nil
  local rule = m.rule(ropts)
  local step = c.rule.step or 1
  local S = (Tn + step - 1) // step
  local k, v = m.randn(B, H, Tn, dk) * 0.5, m.randn(B, H, Tn, dv) * 0.5
  local q = c.q and m.randn(B, H, Tn, dk) * 0.5 or nil
  local theta = m.rand(B, H, Tn) * 0.1 + (c.rule.theta or 0.1)
  local eta = m.rand(B, H, S) * 0.2 + (c.rule.eta or 0.5)
  local alpha = m.rand(B, H, S) * 0.02
  if c.bad then
    local what, b, h, tok, value = table.unpack(c.bad)
    local t = ({ k = k, v = v, theta = theta })[what]
    put_bad(t, b, h, tok, value or (what == "v" and 1 / 0 or 0 / 0))
  end
  -- initial parameters (and momenta) as CPU tensors: both runs start alike
  local init, up = {}, {}
  local np = 0
  for name, t in pairs(rule:run { k = k, v = v, theta = 0.1, seed = 7 + ci }.final) do
    if not name:match("^S_") then
      init[name] = m.randn(table.unpack(t.shape)) * (name:match("^b") and 0.1 or c.wscale or 0.4)
      if c.momenta then init["S_" .. name] = m.randn(table.unpack(t.shape)) * 0.05 end
      if c.dparams ~= false then
        up["d" .. name] = m.randn(table.unpack(t.shape))
        up["dS_" .. name] = m.randn(table.unpack(t.shape)) * 0.5
      end
      np = np + 1
    end
  end
  if c.rule.out_norm then
    -- away from their defaults (1, 0), in the shape the case gives
    local shape = ({ dv = { dv }, H = { H, dv }, BH = { B, H, dv } })[c.ln or "dv"]
    init.ln_g = m.rand(table.unpack(shape)) + 0.5
    init.ln_b = m.randn(table.unpack(shape)) * 0.3
  end
  up.dy = m.randn(B, H, Tn, dv)
  if c.dloss ~= false then up.dloss = m.randn(B, H, Tn) end
  up.block = c.block
  local function run_on(device)
    local ok, res = pcall(rule.run, rule, { k = k, v = v, q = q, theta = theta, eta = eta, alpha = alpha,
                                            init = init, lengths = c.lengths, device = device, grad = true,
                                            precision = device == "cuda" and precision or nil })
    if not ok then return nil, res end
    local ok2, g = pcall(res.backward, res, up)
    if not ok2 then return nil, g end
    return masked(g, c.bad), res
  end
  local gc, ec = run_on("cpu")
  local gg, eg = run_on("cuda")
  local label = "grad_cuda/" .. c.name .. (precision ~= "fp32" and "/" .. precision or "")
  local tol = math.max(c.tol, PREC_TOL * (c.prec_scale or 1))
  -- newton_schulz in tf32 and bf16: the fused backward's products round
  -- G's weak directions, which the iteration lifts (test_conformance.py's
  -- ns_rank_deficient), so finiteness only there as for a kink
  local finite_only = precision ~= "fp32" and (c.tol == KINK or c.rule.precondition ~= nil)
  if c.skips and gc then
    local skipped = ec.outputs.skipped:sum()
    T.ok(label .. "/has_a_skipped_step", (type(skipped) == "number" and skipped or skipped:item()) > 0,
         "the case meant to skip a step skipped none")
  end
  if not gc or not gg then
    T.ok(label .. "/runs", false, "cpu: " .. tostring(ec) .. "; cuda: " .. tostring(eg))
  else
    local names = { "k", "v", "theta", "eta", "alpha" }
    if q then names[#names + 1] = "q" end
    local rows, worst = {}, 0
    local function compare(name, a, b)
      if not a or not b then
        rows[#rows + 1] = name .. " missing on " .. (a and "cpu" or "cuda")
        return
      end
      local e = T.rel(a, b)
      if e > worst then worst = e end
      if not (e <= tol) and not finite_only then rows[#rows + 1] = ("%s rel %.3g"):format(name, e) end
    end
    for _, name in ipairs(names) do compare(name, gg[name], gc[name]) end
    local ninit = 0
    for name, t in pairs(gc.init) do
      compare("init." .. name, gg.init[name], t)
      ninit = ninit + 1
    end
    local nouter = c.rule.out_norm and 2 or 0 -- ln_g, ln_b
    T.ok(label .. "/every_init_gradient", ninit == 2 * np + nouter,
         ("%d init gradients for %d parameters%s"):format(ninit, np, nouter > 0 and " and ln_g, ln_b" or ""))
    T.ok(label, #rows == 0, table.concat(rows, "; ") .. (" (tolerance %g)"):format(tol))
    print(("# %s: worst relative error %.3g (%s)"):format(label, worst,
                                                          finite_only and "kinked: finiteness only" or "tolerance " .. tol))
    -- every entry that must be finite is (the bad token's were masked)
    local finite = true
    for _, name in ipairs(names) do finite = finite and T.rel(gg[name], gg[name]) == 0 end
    T.ok(label .. "/finite", finite, "a gradient of the cuda backward has a NaN")
  end
  ::next_case::
end

T.done()
