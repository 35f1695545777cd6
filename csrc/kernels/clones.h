// COLLECTIVES_CLONES compiles a hot loop twice, for AVX2 and for the baseline x86-64 the
// extension is built for, and picks one when the module loads (GCC/Clang target_clones,
// an ifunc: Linux x86-64 only). Worth it where a loop is compute bound at baseline width:
// the float16 and int8 conversions, and the 1-bit kernels' loops over L1 tiles, whose
// arithmetic gains from AVX2's wider vectors (benchmarks/kernels.py); memory-bound loops
// gain nothing and are not marked. Clones round identically: no FMA, no reassociation.
#pragma once

#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define COLLECTIVES_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define COLLECTIVES_CLONES
#endif
