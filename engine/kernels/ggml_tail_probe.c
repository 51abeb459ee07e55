/* The tail loop of ggml_vec_dot_f32 (ggml-cpu/vec.cpp), `sumf += x[i]*y[i]` over the products
 * left after its 4·lanes vector loop, compiled as pip compiles llama.cpp on this machine: the
 * system compiler, -O3 -march=native, GCC's default -ffp-contract=fast for GNU C.
 *
 * Why it exists: the compiler, not ggml's source, decides those bits. GCC vectorizes the loop's
 * multiplies in groups (each product rounded, the adds kept in order) and contracts what is left
 * into one fma each; how large the groups are follows its tuning for the CPU (8 on an AMD Zen 4,
 * 8 then 4 on a Sapphire Rapids, measured against libggml-cpu). numerics.dot_vec_f32 follows
 * whichever grouping this probe shows (engine/kernels/cpu.py: f32_tail_group).
 */
float fb_vec_dot_f32_tail(int np, int n, const float *x, const float *y) {
    float sumf = 0.0f;
    for (int i = np; i < n; ++i) {
        sumf += x[i]*y[i];
    }
    return sumf;
}
