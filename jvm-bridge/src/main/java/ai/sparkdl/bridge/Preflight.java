package ai.sparkdl.bridge;

import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

import org.apache.spark.SparkConf;
import org.apache.spark.SparkContext;
import org.apache.spark.resource.ResourceProfile;

/**
 * Checks a barrier training job of N ranks would fail on, before it is submitted: too few task
 * slots for N ranks at once (Spark would otherwise wait minutes and then fail), dynamic allocation
 * (barrier stages refuse it), and executors that have GPUs while tasks ask for none (ranks would
 * get no GPU address). Callable from Python ({@link #check}) and as
 * {@code spark-submit --class ai.sparkdl.bridge.Preflight sparkdl-bridge.jar N}, which prints the
 * report as JSON and exits with code 2 when there is a problem.
 */
public final class Preflight {
    private Preflight() {}

    /** The report for `ranks` ranks as JSON: requested, slots, master and a list of problems. */
    public static String check(SparkContext sc, int ranks) {
        ResourceProfile profile = sc.resourceProfileManager().defaultResourceProfile();
        int slots = sc.maxNumConcurrentTasks(profile);
        SparkConf conf = sc.getConf();
        List<String> problems = new ArrayList<>();
        if (slots < ranks) {
            problems.add(problem("slots",
                    "num_workers=" + ranks + " needs " + ranks + " task slots at once, but Spark (" + sc.master()
                            + ") can run only " + slots + " tasks at the same time",
                    "lower num_workers to " + Math.max(slots, 1) + ", or give Spark more executor cores"));
        }
        if (conf.getBoolean("spark.dynamicAllocation.enabled", false)) {
            problems.add(problem("dynamic_allocation",
                    "spark.dynamicAllocation.enabled=true: Spark refuses barrier stages under dynamic allocation",
                    "set spark.dynamicAllocation.enabled=false for the training application"));
        }
        double executorGpus = conf.getDouble("spark.executor.resource.gpu.amount", 0.0);
        if (executorGpus > 0 && !conf.contains("spark.task.resource.gpu.amount")) {
            problems.add(problem("task_gpus",
                    "executors have " + executorGpus + " GPU(s) (spark.executor.resource.gpu.amount) but tasks ask"
                            + " for none, so no rank gets a GPU address",
                    "set spark.task.resource.gpu.amount (1 for one GPU per rank)"));
        }
        Map<String, Object> report = new LinkedHashMap<>();
        report.put("requested", ranks);
        report.put("slots", slots);
        report.put("master", sc.master());
        report.put("problems", new Json.Raw("[" + String.join(", ", problems) + "]"));
        return Json.object(report);
    }

    private static String problem(String code, String message, String fix) {
        Map<String, Object> fields = new LinkedHashMap<>();
        fields.put("code", code);
        fields.put("message", message);
        fields.put("fix", fix);
        return Json.object(fields);
    }

    public static void main(String[] args) throws InterruptedException {
        if (args.length != 1 || !args[0].matches("\\d+")) {
            System.err.println("usage: spark-submit --class ai.sparkdl.bridge.Preflight sparkdl-bridge.jar NUM_WORKERS");
            System.exit(2);
        }
        int ranks = Integer.parseInt(args[0]);
        SparkContext sc = SparkContext.getOrCreate(new SparkConf().setAppName("sparkdl-preflight"));
        int code = 0;
        try {
            // A cluster manager registers executors over a few seconds; a local master is final at once.
            long deadline = System.currentTimeMillis() + (sc.isLocal() ? 0 : 15_000);
            String report = check(sc, ranks);
            while (report.contains("\"code\": \"slots\"") && System.currentTimeMillis() < deadline) {
                Thread.sleep(500);
                report = check(sc, ranks);
            }
            System.out.println(report);
            code = report.contains("\"problems\": []") ? 0 : 2;
        } finally {
            sc.stop();
        }
        System.exit(code);
    }
}
