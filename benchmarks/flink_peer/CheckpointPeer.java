// The Flink 2.3 peer of bench_checkpoint.py's backpressured job (issue 32): the same
// keyed count, run by Flink's DataStream API on an in-process MiniCluster, so that the
// two engines' checkpoint durations are measured on one machine in the same minutes.
//
//   java -cp <flink jars>:<this class> CheckpointPeer RATE SECONDS MODE TOPOLOGY CHECKPOINT_DIR KEYS
//
// RATE: records/s of the rate-limited source; the sink drains RATE / 20. MODE: aligned |
// unaligned. TOPOLOGY: chained (Flink's default: 2 tasks, 1 exchange) | unchained (5 tasks,
// 4 exchanges: source, map, pair, count, sink, as pyflowbuf's benchmark runs it) | rebalance
// (unchained, each forward exchange a rebalance: Flink keeps barriers aligned on pointwise
// exchanges even in unaligned mode, so only this one is unaligned end to end).
// Network buffers are Flink's defaults (2 exclusive a channel, 8 floating a gate, at most
// 10 a channel), 32 KiB segments; a checkpoint every second to CHECKPOINT_DIR (file://).
//
// Prints Flink's own log line for each completed checkpoint (CheckpointCoordinator at INFO,
// the rest of Flink at WARN) and at the end one line
//   PEER sink_records=N sink_seconds=S
// (the sink's records from its first one, over SECONDS, before the cancel). Then it exits
// the JVM.
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.locks.LockSupport;

import org.apache.flink.api.common.eventtime.WatermarkStrategy;
import org.apache.flink.api.common.functions.MapFunction;
import org.apache.flink.api.common.functions.ReduceFunction;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.api.connector.sink2.Sink;
import org.apache.flink.api.connector.sink2.SinkWriter;
import org.apache.flink.api.connector.sink2.WriterInitContext;
import org.apache.flink.api.connector.source.util.ratelimit.RateLimiterStrategy;
import org.apache.flink.api.java.functions.KeySelector;
import org.apache.flink.api.java.tuple.Tuple2;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.connector.datagen.source.DataGeneratorSource;
import org.apache.flink.connector.datagen.source.GeneratorFunction;
import org.apache.flink.core.execution.JobClient;
import org.apache.flink.streaming.api.datastream.DataStream;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;

public class CheckpointPeer {
    // the sink's records, read by main: in a local environment the job's classes come from
    // the application class loader, so the sink subtask and main share this field
    static final AtomicLong SUNK = new AtomicLong();
    // a sink that was idle (waiting for input) does not catch up by more than this (as
    // bench_checkpoint.PACE_SLACK_S)
    static final long PACE_SLACK_NS = 50_000_000L;

    static final class Identity implements GeneratorFunction<Long, Long> {
        public Long map(Long index) { return index; }
    }

    static final class PlusOne implements MapFunction<Long, Long> {
        public Long map(Long x) { return x + 1; }
    }

    static final class Pair implements MapFunction<Long, Tuple2<Long, Long>> {
        final long keys;
        Pair(long keys) { this.keys = keys; }
        public Tuple2<Long, Long> map(Long x) { return Tuple2.of(x % keys, 1L); }
    }

    static final class First implements KeySelector<Tuple2<Long, Long>, Long> {
        public Long getKey(Tuple2<Long, Long> kv) { return kv.f0; }
    }

    static final class Count implements ReduceFunction<Tuple2<Long, Long>> {
        public Tuple2<Long, Long> reduce(Tuple2<Long, Long> a, Tuple2<Long, Long> b) {
            return Tuple2.of(a.f0, a.f1 + b.f1);
        }
    }

    /** Slow per record, paced by deadline: each record's deadline is the last one's plus
     *  1/rate, and the writer parks only while it is ahead of it, so the sink drains rate
     *  records/s whatever a park overshoots; a barrier can come between two records. */
    static final class PacedSink implements Sink<Tuple2<Long, Long>> {
        final double rate;
        PacedSink(double rate) { this.rate = rate; }

        public SinkWriter<Tuple2<Long, Long>> createWriter(WriterInitContext context) {
            final long period = Math.round(1e9 / rate);
            return new SinkWriter<Tuple2<Long, Long>>() {
                long next = System.nanoTime();

                public void write(Tuple2<Long, Long> kv, Context ctx) {
                    long now = System.nanoTime();
                    next = Math.max(next + period, now - PACE_SLACK_NS);
                    for (long ahead = next - now; ahead > 0; ahead = next - System.nanoTime()) {
                        LockSupport.parkNanos(ahead);
                    }
                    SUNK.incrementAndGet();
                }

                public void flush(boolean endOfInput) {}

                public void close() {}
            };
        }
    }

    public static void main(String[] args) throws Exception {
        if (args.length != 6) {
            System.err.println("usage: CheckpointPeer RATE SECONDS aligned|unaligned chained|unchained|rebalance CHECKPOINT_DIR KEYS");
            System.exit(2);
        }
        double rate = Double.parseDouble(args[0]);
        double seconds = Double.parseDouble(args[1]);
        boolean unaligned = args[2].equals("unaligned");
        String topology = args[3];
        if (!topology.equals("chained") && !topology.equals("unchained") && !topology.equals("rebalance")) {
            System.err.println("TOPOLOGY must be chained, unchained or rebalance, got " + topology);
            System.exit(2);
        }
        boolean rebalance = topology.equals("rebalance");
        String dir = args[4];
        long keys = Long.parseLong(args[5]);

        Configuration conf = new Configuration();
        conf.setString("taskmanager.memory.segment-size", "32kb");
        conf.setString("execution.checkpointing.interval", "1s");
        conf.setString("execution.checkpointing.storage", "filesystem");
        conf.setString("execution.checkpointing.dir", dir.startsWith("file:") ? dir : "file://" + dir);
        conf.setString("execution.checkpointing.unaligned.enabled", Boolean.toString(unaligned));
        conf.setString("rest.bind-port", "0");      // several peers may run on one machine
        StreamExecutionEnvironment env = StreamExecutionEnvironment.createLocalEnvironment(1, conf);
        if (!topology.equals("chained")) {
            env.disableOperatorChaining();
        }
        DataGeneratorSource<Long> source = new DataGeneratorSource<>(
            new Identity(), Long.MAX_VALUE, RateLimiterStrategy.perSecond(rate), Types.LONG);
        DataStream<Long> numbers = env.fromSource(source, WatermarkStrategy.noWatermarks(), "sequence");
        if (rebalance) {
            numbers = numbers.rebalance();
        }
        DataStream<Long> mapped = numbers.map(new PlusOne()).name("map");
        if (rebalance) {
            mapped = mapped.rebalance();
        }
        DataStream<Tuple2<Long, Long>> counts = mapped
            .map(new Pair(keys)).returns(Types.TUPLE(Types.LONG, Types.LONG)).name("pair")
            .keyBy(new First())
            .reduce(new Count()).name("count");
        if (rebalance) {
            counts = counts.rebalance();
        }
        counts.sinkTo(new PacedSink(rate / 20)).name("sink");

        JobClient job = env.executeAsync("flink-peer-" + args[2] + "-" + topology);
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(120);
        while (SUNK.get() == 0) {           // the job's start is not part of the measured time
            if (System.nanoTime() > deadline) {
                System.err.println("PEER no record reached the sink in 120 s");
                System.exit(3);
            }
            Thread.sleep(10);
        }
        long c0 = SUNK.get(), t0 = System.nanoTime();
        Thread.sleep((long) (seconds * 1000));
        long c1 = SUNK.get(), t1 = System.nanoTime();
        try {
            job.cancel().get(30, TimeUnit.SECONDS);
        } catch (Exception e) {
            System.err.println("PEER cancel: " + e);
        }
        System.out.printf("PEER sink_records=%d sink_seconds=%.3f%n", c1 - c0, (t1 - t0) / 1e9);
        System.out.flush();
        System.exit(0);                     // the MiniCluster's threads need not linger
    }
}
