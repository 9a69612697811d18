package ai.sparkdl.bridge;

import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ConcurrentLinkedQueue;

import org.apache.spark.ExceptionFailure;
import org.apache.spark.ExecutorLostFailure;
import org.apache.spark.TaskEndReason;
import org.apache.spark.TaskKilled;
import org.apache.spark.resource.ResourceInformation;
import org.apache.spark.scheduler.SparkListener;
import org.apache.spark.scheduler.SparkListenerExecutorAdded;
import org.apache.spark.scheduler.SparkListenerExecutorRemoved;
import org.apache.spark.scheduler.SparkListenerStageCompleted;
import org.apache.spark.scheduler.SparkListenerTaskEnd;
import org.apache.spark.scheduler.StageInfo;
import org.apache.spark.scheduler.TaskInfo;
import org.apache.spark.storage.RDDInfo;

import scala.jdk.javaapi.CollectionConverters;

/**
 * A SparkListener that records what a barrier training job needs to explain a failure: executors
 * added (with GPU addresses) and removed (with the reason), failed tasks (partition = rank, executor,
 * host and the Python exception line pulled out of the traceback) and failed stages, flagged when
 * they are barrier stages. Python drains the events as JSON through py4j ({@link #drain()}).
 *
 * Spark creates the listener itself (spark.extraListeners) or sparkdl adds one at run time; either
 * way events go to one static queue, bounded so that a long-lived session cannot grow it forever.
 */
public class BarrierWatch extends SparkListener {
    static final String FAILURE_MARKER = "SPARKDL_RANK_FAILED";
    private static final int MAX_EVENTS = 10_000;
    private static final ConcurrentLinkedQueue<String> EVENTS = new ConcurrentLinkedQueue<>();
    private static volatile boolean installed = false;

    public BarrierWatch() {
        installed = true;
    }

    /** True once Spark (or sparkdl) created a listener in this JVM. */
    public static boolean isInstalled() {
        return installed;
    }

    /** Every event recorded since the last call, as a JSON array, oldest first. */
    public static String drain() {
        List<String> out = new ArrayList<>();
        String event;
        while ((event = EVENTS.poll()) != null) {
            out.add(event);
        }
        return "[" + String.join(", ", out) + "]";
    }

    static void record(Map<String, Object> fields) {
        fields.put("time_ms", System.currentTimeMillis());
        EVENTS.add(Json.object(fields));
        while (EVENTS.size() > MAX_EVENTS) {
            EVENTS.poll();
        }
    }

    @Override
    public void onExecutorAdded(SparkListenerExecutorAdded added) {
        Map<String, Object> fields = new LinkedHashMap<>();
        fields.put("event", "executor_added");
        fields.put("executor", added.executorId());
        fields.put("host", added.executorInfo().executorHost());
        fields.put("cores", added.executorInfo().totalCores());
        List<String> gpus = new ArrayList<>();
        Map<String, ResourceInformation> resources = CollectionConverters.asJava(added.executorInfo().resourcesInfo());
        ResourceInformation gpu = resources.get("gpu");
        if (gpu != null) {
            for (String address : gpu.addresses()) {
                gpus.add(Json.quote(address));
            }
        }
        fields.put("gpus", new Json.Raw("[" + String.join(", ", gpus) + "]"));
        record(fields);
    }

    @Override
    public void onExecutorRemoved(SparkListenerExecutorRemoved removed) {
        Map<String, Object> fields = new LinkedHashMap<>();
        fields.put("event", "executor_removed");
        fields.put("executor", removed.executorId());
        fields.put("reason", removed.reason());
        record(fields);
    }

    @Override
    public void onTaskEnd(SparkListenerTaskEnd end) {
        TaskEndReason reason = end.reason();
        TaskInfo info = end.taskInfo();
        if (info == null || !info.failed() && !info.killed()) {
            return;
        }
        Map<String, Object> fields = new LinkedHashMap<>();
        fields.put("event", "task_failed");
        fields.put("stage", end.stageId());
        fields.put("stage_attempt", end.stageAttemptId());
        fields.put("rank", info.partitionId());
        fields.put("executor", info.executorId());
        fields.put("host", info.host());
        fields.put("killed", info.killed());
        if (reason instanceof ExceptionFailure) {
            ExceptionFailure failure = (ExceptionFailure) reason;
            fields.put("kind", "exception");
            fields.put("exception", failure.className());
            fields.put("line", exceptionLine(failure.description()));
        } else if (reason instanceof ExecutorLostFailure) {
            fields.put("kind", "executor_lost");
            fields.put("line", ((ExecutorLostFailure) reason).toErrorString());
        } else if (reason instanceof TaskKilled) {
            fields.put("kind", "killed");
            fields.put("line", ((TaskKilled) reason).reason());
        } else {
            fields.put("kind", reason.getClass().getSimpleName());
            fields.put("line", reason.toString());
        }
        record(fields);
    }

    @Override
    public void onStageCompleted(SparkListenerStageCompleted completed) {
        StageInfo stage = completed.stageInfo();
        if (stage.failureReason().isEmpty()) {
            return;
        }
        boolean barrier = false;
        for (RDDInfo rdd : CollectionConverters.asJava(stage.rddInfos())) {
            barrier |= rdd.isBarrier();
        }
        Map<String, Object> fields = new LinkedHashMap<>();
        fields.put("event", "stage_failed");
        fields.put("stage", stage.stageId());
        fields.put("stage_attempt", stage.attemptNumber());
        fields.put("barrier", barrier);
        fields.put("name", stage.name());
        fields.put("reason", firstLine(stage.failureReason().get()));
        record(fields);
    }

    /**
     * The line that says what went wrong in a Python task's traceback: sparkdl's own marker line
     * ("SPARKDL_RANK_FAILED rank=N: ValueError: ...") when present, else the last line that looks
     * like "SomeError: message".
     */
    static String exceptionLine(String description) {
        if (description == null) {
            return "";
        }
        String found = null;
        for (String raw : description.split("\n")) {
            String line = raw.trim();
            int marker = line.indexOf(FAILURE_MARKER);
            if (marker >= 0) {
                return line.substring(marker);
            }
            if (line.matches("^[A-Za-z_][\\w.]*(Error|Exception|Interrupt|Exit)\\b.*")) {
                found = line;
            }
        }
        return found != null ? found : firstLine(description);
    }

    static String firstLine(String text) {
        int newline = text.indexOf('\n');
        return newline < 0 ? text : text.substring(0, newline);
    }
}
