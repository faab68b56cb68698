// Loss-spike detection: the z-score of each step's loss against the losses of the previous
// `window` steps, z = (x - mean) / std. A spike (z of several units) is the early sign of a
// diverging run; it is logged on the step line and in log.jsonl ("loss_z") for the user to act on.
//
// The mean and standard deviation are recomputed from the window each step (window is ~100
// values, so this is free next to a training step) rather than kept as running sums, which lose
// precision to cancellation over a long run. Non-finite losses never enter the window (they are
// the bad steps the trainer skips), so one NaN cannot poison the statistics.
#pragma once
#include <cmath>
#include <cstddef>
#include <vector>

struct LossOutlierDetector {
    size_t window = 128, min_count = 8;  // no z-score until min_count losses have been seen
    std::vector<double> ring;
    size_t next = 0;

    explicit LossOutlierDetector(size_t window_ = 128, size_t min_count_ = 8)
        : window(window_ < 2 ? 2 : window_), min_count(min_count_ < 2 ? 2 : min_count_) {}

    // z-score of x against the values seen so far (NaN while there are fewer than min_count of
    // them, or when they are all equal), then x joins the window when it is finite.
    double update(double x) {
        double z = std::nan("");
        if (std::isfinite(x) && ring.size() >= min_count) {
            double mean = 0, var = 0;
            for (double v : ring) mean += v;
            mean /= ring.size();
            for (double v : ring) var += (v - mean) * (v - mean);
            const double sd = std::sqrt(var / (ring.size() - 1));
            if (sd > 0) z = (x - mean) / sd;
        }
        if (std::isfinite(x)) {
            if (ring.size() < window) ring.push_back(x);
            else ring[next] = x;
            next = (next + 1) % window;
        }
        return z;
    }
};
